"""A pool's prefix-cache counts, as RolloutClient.stats() reports them: per worker slot and for the pool, the
prompt tokens of the rollouts served and how many of those the workers' prefix caches served
(RolloutStats.cached_prompt_tokens, from engines with capabilities().prefix_cache: vLLM workers).

Rule: the counts are the pool's, kept per slot as rollouts come back, so they only grow: a worker that dies
takes nothing with it, and the hit rate between two stats() snapshots is their difference (`between`).
A pool none of whose workers has a prefix cache (native engines) reports None, not a rate of 0.
"""
from __future__ import annotations


def counts(prompt_tokens: int, cached_tokens: int) -> dict:
    """The counts as stats() shows them, with their hit rate (0.0 before any prompt token)."""
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0}


def slot_counts(slot) -> dict | None:
    """A WorkerSlot's counts, or None where its engine has no prefix cache (or has not started yet)."""
    caps = slot.info.get("capabilities")
    if caps is None or not getattr(caps, "prefix_cache", False):
        return None
    return counts(slot.prompt_tokens, slot.cached_prompt_tokens)


def pool_counts(workers: list[dict]) -> dict | None:
    """The sum over stats()'s workers that have a prefix cache; None where none has one."""
    cached = [w["prefix_cache"] for w in workers if w.get("prefix_cache") is not None]
    if not cached:
        return None
    return counts(sum(c["prompt_tokens"] for c in cached), sum(c["cached_tokens"] for c in cached))


def between(before: dict, after: dict) -> dict | None:
    """The pool's counts from one stats() snapshot to a later one (e.g. over one training step), or None
    where the pool has no prefix cache."""
    a, b = after.get("prefix_cache"), before.get("prefix_cache")
    if a is None:
        return None
    b = b or counts(0, 0)
    return counts(a["prompt_tokens"] - b["prompt_tokens"], a["cached_tokens"] - b["cached_tokens"])
