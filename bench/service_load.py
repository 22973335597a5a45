"""Load on the Ray rollout service: many concurrent requests from several client threads.

    python bench/service_load.py --workers 2 --requests 2000 --threads 8

Prints one JSON object: completions, lost/duplicated counts, throughput and latency percentiles.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

from rollout_service import SamplingParams
from rollout_service.tiny_models import tiny_model


def load_requests(num_requests: int, vocab_size: int = 96, max_tokens: tuple[int, int] = (4, 8)):
    """Distinct tiny prompts (so a result can be matched to its request) with seeded sampling."""
    lo, hi = max_tokens
    reqs = []
    for i in range(num_requests):
        prompt = [1 + i % (vocab_size - 1), 1 + (i // (vocab_size - 1)) % (vocab_size - 1), 1 + i % 7]
        params = SamplingParams(max_tokens=lo + i % (hi - lo + 1), temperature=1.0, seed=i)
        reqs.append((f"load-{i}", prompt, params))
    return reqs


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def run_load(client, num_requests: int = 2000, num_threads: int = 8, max_tokens=(4, 8),
             results_out: dict | None = None) -> dict:
    """Every thread sends its share of requests at once (one generate_async call per request) and
    waits for all of them; all threads start together. results_out, if given, receives
    {request id: (prompt, params, [rollouts])}."""
    reqs = load_requests(num_requests, max_tokens=max_tokens)
    shares = [reqs[t::num_threads] for t in range(num_threads)]
    results: dict[str, list] = {}  # request id -> rollouts received (more than one = duplicated)
    latencies: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(num_threads + 1)
    errors: list[BaseException] = []

    async def one(key, prompt, params):
        t0 = time.perf_counter()
        [rollout] = await client.generate_async([prompt], params, request_ids=[key])
        with lock:
            latencies.append(time.perf_counter() - t0)
            results.setdefault(key, []).append(rollout)

    def thread_main(share):
        async def main():
            await asyncio.gather(*(one(*r) for r in share))
        try:
            start.wait()
            asyncio.run(main())
        except BaseException as e:  # reported below, not swallowed
            errors.append(e)

    before = client.stats()
    threads = [threading.Thread(target=thread_main, args=(s,), daemon=True) for s in shares]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, client.stats()["in_flight"])
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    after = client.stats()
    if errors:
        raise errors[0]

    if results_out is not None:
        results_out.update({key: (prompt, params, results.get(key, [])) for key, prompt, params in reqs})
    expected = {key: prompt for key, prompt, _ in reqs}
    got = [rs[0] for rs in results.values()]
    worker_done = sum(w["completed"] for w in after["workers"]) - sum(w["completed"] for w in before["workers"])
    return {
        "requests": num_requests,
        "client_threads": num_threads,
        "workers": len(after["workers"]),
        "completed": sum(r.ok for r in got),
        "errors": sum(r.finish_reason == "error" for r in got),
        "lost": len(expected.keys() - results.keys()),
        "duplicated": sum(len(rs) - 1 for rs in results.values()),
        "mismatched_prompts": sum(results[k][0].prompt_token_ids != p for k, p in expected.items() if k in results),
        "worker_executions": worker_done,  # == requests: nothing ran twice
        "peak_in_flight": peak,
        "wall_s": round(wall, 3),
        "throughput_req_s": round(num_requests / wall, 1),
        "throughput_tok_s": round(sum(len(r.token_ids) for r in got) / wall, 1),
        "latency_p50_s": round(_percentile(latencies, 0.50), 3),
        "latency_p99_s": round(_percentile(latencies, 0.99), 3),
        "latency_max_s": round(max(latencies), 3) if latencies else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    args = ap.parse_args()

    import ray

    from rollout_service import start_pool  # imports ray

    ray.init(address=args.address or "local", num_cpus=None if args.address else args.workers + 1,
             include_dashboard=False, log_to_driver=False)
    pool = start_pool(tiny_model("qwen2"), num_workers=args.workers, name="rollout-load",
                       engine_kwargs=dict(window=args.window, group=args.group))
    try:
        report = run_load(pool, args.requests, args.threads, (args.min_tokens, args.max_tokens))
    finally:
        pool.shutdown()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
