"""The `rollout` section of the recipe config."""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout_service.params import Determinism

from .errors import ConfigError


@dataclass(frozen=True)
class RolloutConfig:
    """The `rollout` section: the pool of rollout workers and how each rollout is sampled."""
    num_workers: int = 2
    """Rollout workers (Ray actors, one engine each) in the pool; colocated: equal to trainer.num_ranks."""
    pool_name: str | None = None
    """The pool's Ray actor name; null: grpo-<random hex>, unique per run."""
    engine: dict = field(default_factory=dict)
    """Every worker's engine options, forwarded verbatim: EngineConfig and ParallelConfig fields, or a vLLM
    engine's; RolloutWorker / EngineConfig check them."""
    resources_per_worker: dict = field(default_factory=lambda: {"num_cpus": 1})
    """Ray actor options of each worker, forwarded verbatim (e.g. {num_cpus: 2, num_gpus: 1}); by node or by
    resource: `resources: {<a node's custom resource>: <share>}` (placement groups' bundles keep it)."""
    placement_strategy: str | None = None
    """placement split: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD puts the workers in one placement group of
    a bundle each, placed by that Ray strategy (e.g. SPREAD: one worker a node where it can); null: each
    worker a Ray actor of its own, placed by Ray. Workers of tensor_parallel_size > 1 take a group each:
    null there."""
    start_timeout_s: float = 120.0
    """Seconds a worker may take to build its engine (> 0); a stock vLLM engine compiles its graphs (inductor)
    on first start, which on a fresh GPU machine takes minutes."""
    determinism: Determinism = Determinism.VERIFIED
    """Every request's determinism mode: verified | invariant | off (numerics stock: off)."""
    n: int = 8
    """Samples per prompt (the GRPO group), each with its own seed; at least 2."""
    max_tokens: int = 16
    """Most tokens generated per rollout; with length_distribution lognormal, the cap of every drawn budget."""
    length_distribution: str = "fixed"
    """Each request's max_tokens: fixed (every request rollout.max_tokens) | lognormal (drawn per request,
    median length_median, log-space std length_sigma, clipped to [1, max_tokens]): completions whose
    lengths vary inside a batch as reasoning rollouts' do. A draw is a pure function of (run seed, step,
    prompt index, sample index), like the sampling seed (recipes.rollouts.completion_budget)."""
    length_median: int | None = None
    """lognormal: the median drawn max_tokens, 1 .. max_tokens (required there)."""
    length_sigma: float = 0.7
    """lognormal: the std of the budget's logarithm, >= 0; 0.7 puts a 10x spread between the 5th and 95th
    percentiles (exp(2 x 1.645 x 0.7) = 10)."""
    temperature: float = 1.0
    """Sampling temperature, >= 0 (0: greedy); the trainer's log-probs use it too (0: 1.0 there)."""
    top_k: int = -1
    """Top-k sampling; -1 or 0: off."""
    top_p: float = 1.0
    """Top-p (nucleus) sampling, in (0, 1]; 1.0: off."""
    sleep_while_training: bool = True
    """placement colocated: the engines release their memory (vLLM's sleep mode) while the trainer steps,
    and wake for the next push. false keeps them awake and holding it (TRL colocate's default; verl's
    free_cache_engine: false): no sleep and no wake in the step, where the GPU has memory for both."""
    return_routed_experts: bool | None = None
    """Record each token's MoE routing and log rollout_train/routing_agreement; null: on for MoE policies on
    native-engine workers without TP (recipes.rollouts.records_routing)."""

    def __post_init__(self):
        try:  # the YAML's string (or a caller's, also on dataclasses.replace) as its Determinism
            object.__setattr__(self, "determinism", Determinism.parse(self.determinism))
        except ValueError as e:
            raise ConfigError(f"rollout.determinism {e}") from None
