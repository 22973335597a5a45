"""A pool's slot for one worker: the actor now in it, its state, its counts and the weights it holds.
The counts are the slot's, not the actor's: they go on across the worker's restarts."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerSlot:
    index: int
    actor: object = None
    state: str = "starting"  # starting | ready | restarting | stale | failed | stopped
    placement: object = None
    in_flight: int = 0
    completed: int = 0
    restarts: int = 0
    failed_restarts: int = 0  # replacements that failed since this slot last served
    weight_version: int = 0  # the version of the weights this worker verifiably holds
    error: str | None = None
    info: dict = field(default_factory=dict)
    # of the rollouts that ran here (stop or length): their prompt tokens, and those the prefix cache served
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0

    def served(self, rollout) -> None:
        """Count a rollout this slot's worker returned (service/prefix_cache_stats.py reads the counts)."""
        self.completed += 1
        if rollout.finish_reason in ("stop", "length"):
            self.prompt_tokens += len(rollout.prompt_token_ids)
            self.cached_prompt_tokens += rollout.stats.cached_prompt_tokens
