"""The pool's prefix-cache counts (rollout_service.service.prefix_cache_stats) and the recipe's metrics from
them, without Ray: a slot counts the rollouts that ran, keeps its counts across its worker's restarts, and a
pool without a prefix cache reports None (no rate of 0 that would read as a cold cache)."""
from __future__ import annotations

from recipes.prefix_cache_metrics import prefix_cache_metrics
from rollout_service import Rollout
from rollout_service.engine.protocol import EngineCapabilities
from rollout_service.service.prefix_cache_stats import between, pool_counts, slot_counts
from rollout_service.service.worker_slot import WorkerSlot

NATIVE = EngineCapabilities(switch_modes=True, routing_records=True, bucketed_push=True, sleep=False)
VLLM = EngineCapabilities(switch_modes=False, routing_records=False, bucketed_push=True, sleep=False, prefix_cache=True)


def _rollout(prompt_len: int, cached: int, reason: str = "length") -> Rollout:
    r = Rollout(list(range(prompt_len)), [1], [0.0], reason, None if reason in ("stop", "length") else "x")
    r.stats.cached_prompt_tokens = cached
    return r


def _stats(slots) -> dict:
    workers = [{"index": s.index, "prefix_cache": slot_counts(s)} for s in slots]
    return {"workers": workers, "prefix_cache": pool_counts(workers)}


def test_a_slot_counts_the_rollouts_that_ran():
    slot = WorkerSlot(0, info={"capabilities": VLLM})
    for r in (_rollout(40, 32, "stop"), _rollout(10, 0), _rollout(50, 0, "error"), _rollout(70, 64, "abort")):
        slot.served(r)
    assert slot.completed == 4
    assert slot_counts(slot) == {"prompt_tokens": 50, "cached_tokens": 32, "hit_rate": 32 / 50}
    slot.info = {"capabilities": VLLM, "pid": 2}  # a replacement worker: the slot's counts go on
    slot.served(_rollout(50, 48))
    assert slot_counts(slot) == {"prompt_tokens": 100, "cached_tokens": 80, "hit_rate": 0.8}


def test_the_pools_counts_and_the_recipes_metrics_between_two_snapshots():
    a, b = WorkerSlot(0, info={"capabilities": VLLM}), WorkerSlot(1, info={"capabilities": VLLM})
    a.served(_rollout(40, 0))
    before = _stats([a, b])
    a.served(_rollout(60, 32))
    b.served(_rollout(100, 64))
    after = _stats([a, b])
    assert after["prefix_cache"] == {"prompt_tokens": 200, "cached_tokens": 96, "hit_rate": 0.48}
    assert between(before, after) == {"prompt_tokens": 160, "cached_tokens": 96, "hit_rate": 0.6}
    assert prefix_cache_metrics(before, after) == {"rollout/prefix_cache_hit_rate": 0.6,
                                                   "rollout/prefix_cache_hit_tokens": 96,
                                                   "rollout/prefix_cache_prompt_tokens": 160}
    assert between(after, after)["hit_rate"] == 0.0  # nothing served in between


def test_a_pool_without_a_prefix_cache_reports_none():
    native, starting = WorkerSlot(0, info={"capabilities": NATIVE}), WorkerSlot(1)
    for slot in (native, starting):
        slot.served(_rollout(40, 0))
    stats = _stats([native, starting])
    assert stats["prefix_cache"] is None and all(w["prefix_cache"] is None for w in stats["workers"])
    assert between(stats, stats) is None and prefix_cache_metrics(stats, stats) == {}
    assert EngineCapabilities.common([NATIVE, VLLM]).prefix_cache is False
    assert EngineCapabilities.common([VLLM, VLLM]).prefix_cache is True
