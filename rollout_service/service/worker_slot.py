"""A pool's slot for one worker: the actor now in it, its state, its counts and the weights it holds."""
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
