"""The allowed values of the recipe config's string keys (checked at load, recipes.config.checks)."""
from rollout_service.service.weight_sync import TRANSPORTS

from ..grpo_loss import ROLLOUT_CORRECTIONS  # noqa: F401  (defined beside the loss they change)

TASK_KINDS = ("tiny", "tiny_tools", "gsm8k")
MODEL_SOURCES = ("tiny", "hf")
OLD_LOGPROBS = ("rollout", "recompute")
TRAINER_DEVICES = ("cpu", "cuda")
NUMERICS = ("canonical", "stock")
PLACEMENTS = ("split", "colocated")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement-group strategies
WEIGHT_TRANSPORTS = ("auto", *TRANSPORTS)
LENGTH_DISTRIBUTIONS = ("fixed", "lognormal")
