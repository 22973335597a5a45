"""The weights a GRPO step trained, pushed to the rollout pool: the pool's count of pushes and the run's
version of the weights (its step), and the versions the trainer ranks keep for asynchronous steps."""
from __future__ import annotations

import time

from rollout_service.service.client import RolloutClient


def sync_weights(trainer, pool: RolloutClient, step: int, keep_versions: int, overlap: bool = False) -> dict:
    """Push the trainer's weights after `step` (0: the starting weights); the result carries the pool's
    weight version that now holds them and the run's version of those weights, `step`: a pool counts
    its own pushes, a run (resumed or not) counts steps. The trainer ranks keep the newest versions
    when asynchronous steps will score rollouts of older ones.

    overlap (asynchronous steps): a staged push returns once its checks have passed and the pool has
    drained, and sends behind the next train step; the next call (or landed at the end) first waits for
    it to land. Its seconds ("seconds") are what the caller waited for: that wait,
    then this push up to its send; "behind_send" / "behind_finish" in phases ran behind the last step.
    Otherwise a push queued behind the train step (TrainerGroup.train_step's push_to) may have started
    before this call: "seconds" is this call's wait, phases["push"] the push's own time on rank 0."""
    start = time.perf_counter()
    last = landed(trainer)
    result = trainer.push_weights(pool, overlap)
    result["phases"]["push"] = result["seconds"]
    if result["pool_version"] is None:
        result["pool_version"] = pool.stats()["weight_version"]
    result["version"] = step
    if keep_versions:
        trainer.keep_version(step, keep_versions)
    if last is not None:
        result["phases"].update({"wait": last["wait"], **{f"behind_{k}": v for k, v in last["behind"].items()}})
    result["seconds"] = time.perf_counter() - start
    return result


def landed(trainer) -> dict | None:
    """Wait for a push still sending (see sync_weights) to land (its verdict is the pool's, which adopts only the
    digest the push checked)."""
    return trainer.finish_push()


def to_run_versions(rollouts, pool_version: int, run_version: int) -> None:
    """Rollouts' weight versions from the pool's count of pushes to the run's (the step of the weights)."""
    shift = run_version - pool_version
    for ro in rollouts:
        if ro.weight_versions is not None:
            ro.weight_versions = [v + shift for v in ro.weight_versions]
