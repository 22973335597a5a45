"""Recipe configuration: typed sections whose field defaults are the recipe's defaults, read from a
YAML file and `key.sub=value` overrides, and checked once, with every error naming its dotted key.

    cfg = load_config("recipes/configs/tiny.yaml", ["trainer.optimizer.lr=2e-3"])
    cfg.rollout.n, cfg.trainer.optimizer.lr   # typed attributes
    cfg.to_dict()                             # plain data: wandb, the run's config.yaml (to_yaml)

One module per part: the sections (task, model, rollout, trainer, run), the whole config (recipe), reading
(loader), the checks (checks, choices) and the keys that moved (renamed).
"""
from .checks import NUMERIC_RANGES
from .choices import (
    LENGTH_DISTRIBUTIONS,
    MODEL_SOURCES,
    NUMERICS,
    OLD_LOGPROBS,
    PLACEMENT_STRATEGIES,
    PLACEMENTS,
    TASK_KINDS,
    TRAINER_DEVICES,
    WEIGHT_TRANSPORTS,
)
from .errors import ConfigError
from .loader import SHIPPED_CONFIGS, apply_override, coerce_numbers, read_config_file
from .model import CanonicalTreeConfig, ModelConfig, WarmupConfig
from .recipe import RecipeConfig, load_config
from .renamed import RENAMED_KEYS, ConfigKeyDeprecated
from .rollout import RolloutConfig
from .run import MetricsConfig, TrainLoopConfig
from .task import TaskConfig
from .trainer import (
    BatchingConfig,
    LossConfig,
    OptimizerConfig,
    RankPlacementConfig,
    TrainerConfig,
    WeightPushConfig,
)

__all__ = [
    "LENGTH_DISTRIBUTIONS",
    "MODEL_SOURCES",
    "NUMERICS",
    "NUMERIC_RANGES",
    "OLD_LOGPROBS",
    "PLACEMENTS",
    "PLACEMENT_STRATEGIES",
    "RENAMED_KEYS",
    "SHIPPED_CONFIGS",
    "TASK_KINDS",
    "TRAINER_DEVICES",
    "WEIGHT_TRANSPORTS",
    "BatchingConfig",
    "CanonicalTreeConfig",
    "ConfigError",
    "ConfigKeyDeprecated",
    "LossConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RankPlacementConfig",
    "RecipeConfig",
    "RolloutConfig",
    "TaskConfig",
    "TrainLoopConfig",
    "TrainerConfig",
    "WarmupConfig",
    "WeightPushConfig",
    "apply_override",
    "coerce_numbers",
    "load_config",
    "read_config_file",
]
