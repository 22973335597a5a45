"""The rollout pool's prefix-cache hits as a step's metrics: how much of the prompts' prefill its vLLM workers
took from their prefix caches (multi-turn episodes: a later turn's context up to its last turn, when the turn
lands on a worker that holds it). Counted by the pool (rollout_service.service.prefix_cache_stats)."""
from __future__ import annotations

from rollout_service.service.prefix_cache_stats import between


def prefix_cache_metrics(before: dict, after: dict) -> dict:
    """rollout/prefix_cache_* metrics from two of the pool's stats() snapshots (e.g. one taken at the previous
    step's metrics, one now): the prompt tokens served in between, those the prefix caches served, and their
    ratio; {} where no worker has a prefix cache (native engines)."""
    span = between(before, after)
    if span is None:
        return {}
    return {"rollout/prefix_cache_hit_rate": span["hit_rate"],
            "rollout/prefix_cache_hit_tokens": span["cached_tokens"],
            "rollout/prefix_cache_prompt_tokens": span["prompt_tokens"]}
