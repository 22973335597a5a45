"""How many of a request's prompt tokens vLLM served from its prefix cache, in the versions we run (0.25
on GPU, 0.32 on CPU).

Per request, both versions report it as `RequestOutput.num_cached_tokens`: the scheduler fills a
`PrefillStats` when it first schedules the request (its local prefix-cache hit plus any KV connector's,
of which we run none) and the output processor copies its `num_cached_tokens` into every output of the
request, FINAL_ONLY ones included. It is kept whether or not vLLM's stat logging is on. 0.32 also takes a
remote prefill's count there (disaggregated prefill, which we do not run); 0.25 has no such path. For a
request preempted and scheduled again, 0.32 keeps the count of its first admission (it sets it only while
num_preemptions is 0); 0.25 takes the count of its last admission before its first output.

Aggregated, the same counts are vLLM's Prometheus counters `vllm:prefix_cache_queries` (prompt tokens
looked up) and `vllm:prefix_cache_hits` (tokens found), the same names in both versions, read with
`LLM.get_metrics()`. 0.32 records a request's lookup when the scheduler admits it (once, unless it is
preempted); 0.25 records every lookup, so a request that waits for KV blocks is counted again each step it
is looked up and not admitted. We count per request instead because those counters need stat logging, which
vllm.LLM turns off unless `disable_log_stats=False` is passed (its per-step statistics cost the engine
loop), and they live in one process-wide registry to which every engine of the process adds (a worker's
canonical and stock engines, a benchmark's systems). `metric_counts` reads them where logging is on: the
tests check our per-request counts against them.

A prompt's last token is never served from the cache (vLLM computes it to sample the first new token),
and only whole blocks are reused, so a hit is at most (prompt tokens - 1) rounded down to the block size.
"""
from __future__ import annotations

QUERIES_METRIC = "vllm:prefix_cache_queries"
HITS_METRIC = "vllm:prefix_cache_hits"


def cached_prompt_tokens(output) -> int:
    """Prompt tokens of a finished vLLM RequestOutput that its engine took from the prefix cache."""
    return int(getattr(output, "num_cached_tokens", None) or 0)


def metric_counts(metrics) -> tuple[int, int]:
    """(prompt tokens looked up, tokens found) in the prefix cache, summed over every engine in the
    process, from `LLM.get_metrics()` (stat logging on)."""
    totals = {QUERIES_METRIC: 0, HITS_METRIC: 0}
    for metric in metrics:
        if metric.name in totals:
            totals[metric.name] += int(metric.value)
    return totals[QUERIES_METRIC], totals[HITS_METRIC]
