"""The run's own sections of the recipe config: `train` (the loop) and `metrics` (logging)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainLoopConfig:
    """The `train` section: how many steps, how many prompts each, and what is saved."""
    steps: int = 10
    """GRPO steps of the run (a resumed run continues up to this step)."""
    prompts_per_step: int = 8
    """Prompts per step, each sampled rollout.n times; divisible by trainer.batching.mini_batches."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    save_final: bool = True
    """Checkpoint the last step (benchmarks turn it off: it is no step's work)."""
    save_rollouts: bool = False
    """Write every step's rollouts and rewards to <run_dir>/rollouts/step_NNNNNN.jsonl."""
    async_steps: int = 0
    """k > 0: the rollouts of steps s+1 .. s+k are generated while the trainer does step s (placement split,
    numerics canonical, trainer.loss.old_logprobs rollout); 0: each step's rollouts, then its update."""


@dataclass(frozen=True)
class MetricsConfig:
    """The `metrics` section: wandb logging (<run_dir>/metrics.jsonl is written either way)."""
    wandb: bool = True
    """Log every step's numeric metrics (and the config) to wandb."""
    wandb_project: str = "zerokl"
    """The wandb project."""
    wandb_mode: str | None = None
    """wandb's mode (e.g. online, offline; disabled: no wandb run); null: WANDB_MODE, else online when logged
    in, else offline."""

