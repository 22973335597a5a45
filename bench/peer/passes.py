"""Timed passes inside one process: one system's, several systems' in turn, or our own engine's; and
the process's entry point, which prints its result as a RESULT line."""
from __future__ import annotations

import dataclasses
import json
import time

from bench.peer.engines import on_cpu, vllm_options, workload
from bench.peer.report import median
from bench.peer.systems import INTERLEAVED
from bench.peer.warm import Warmed, warm


def run_warmed(args, prompts, system: str) -> dict:
    warmed = warm(args, prompts, system)
    try:
        timed, outs = timed_runs(args, warmed.generate)
        return warmed.result(timed, outs)
    finally:
        warmed.close()


def run_interleaved(args, prompts, systems: list[str]) -> dict:
    """Every system's engine in this one process, their timed passes taken in turn (pass t starts with
    system t mod n): the process's host speed and the machine's drift fall on each system alike, where
    separate processes each draw their own. Returns each system's result, with each pass's ratio to
    stock vLLM's pass of the same turn (`passes_x_vllm`), their median, and the ratio of all the passes'
    times (`x_vllm_all_passes`)."""
    engines: dict[str, Warmed] = {}
    try:
        for system in systems:
            engines[system] = warm(args, prompts, system)
        times: dict[str, list[float]] = {system: [] for system in systems}
        outs = {}
        for t in range(args.timed_runs):
            for system in systems[t % len(systems):] + systems[:t % len(systems)]:
                elapsed, outs[system] = engines[system].generate()
                times[system].append(elapsed)
        results = {system: engines[system].result(pass_times(times[system]), outs[system]) for system in systems}
    finally:
        for warmed in engines.values():
            warmed.close()
    if "vllm" in times:
        for system, res in results.items():
            ratios = [b / x for x, b in zip(times[system], times["vllm"])]
            res.update(passes_x_vllm=[round(r, 3) for r in ratios], x_vllm_passes_median=round(median(ratios), 3),
                       x_vllm_all_passes=round(sum(times["vllm"]) / sum(times[system]), 3))
    return results


def pass_times(times: list[float]) -> dict:
    """The timed passes of one process: the median pass's seconds and every pass's. Passes are kept to
    0.1 ms: a tiny model's pass takes a few ms, where rounding to the ms would move its ratios."""
    return dict(seconds=sorted(times)[len(times) // 2], timed_runs_s=[round(t, 4) for t in times])


def timed_runs(args, run) -> tuple[dict, list]:
    """run() -> (seconds, outputs), --timed-runs times in this process: the median's seconds, every
    run's seconds, and the last run's outputs."""
    times, outs = [], None
    for _ in range(args.timed_runs):
        elapsed, outs = run()
        times.append(elapsed)
    return pass_times(times), outs


def run_ours(args, prompts, mode, fast_path) -> dict:
    from rollout_service import Engine, SamplingParams
    device = "cpu" if on_cpu() else "cuda"
    engine = Engine(args.model, fast_path=fast_path, window=args.window, group=args.group, device=device,
                    max_model_len=args.prompt_len + args.max_tokens + 8,
                    kv_cache_tokens=len(prompts) * (args.prompt_len + args.max_tokens + 32),
                    max_num_seqs=len(prompts), fast_path_options=vllm_options(args) if fast_path == "vllm" else None,
                    verified_decode=args.verified_decode)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                             seed=args.seed + i, determinism=mode) for i in range(len(prompts))]
    engine.generate(prompts, [dataclasses.replace(p, max_tokens=min(args.warmup_tokens, p.max_tokens))
                              for p in params])  # warm-up: every prefill shape of the workload

    def run():
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return time.perf_counter() - start, outs
    timed, outs = timed_runs(args, run)
    bad = [o.error for o in outs if not o.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} rollouts failed: {bad[0]}")
    proposed = sum(o.stats.proposed_tokens for o in outs)
    res = dict(**timed, generated_tokens=sum(len(o.token_ids) for o in outs))
    if mode == "verified":
        res.update(acceptance=sum(o.stats.accepted_tokens for o in outs) / max(proposed, 1),
                   rollbacks=sum(o.stats.rollbacks for o in outs),
                   verify_windows=sum(o.stats.verify_windows for o in outs))
    return res


def run_worker(args) -> None:
    import faulthandler

    import transformers
    if args.timeout > 60:  # a hang shows where it waits, 30 s before the kill (a dump during start-up can crash)
        faulthandler.dump_traceback_later(args.timeout - 30, exit=False)
    vocab = transformers.AutoConfig.from_pretrained(args.model).vocab_size
    prompts = workload(args, vocab)
    system = args.worker
    try:
        if system.startswith(INTERLEAVED):
            print("RESULT " + json.dumps(run_interleaved(args, prompts, system[len(INTERLEAVED):].split(","))),
                  flush=True)
            return
        if system.startswith(("vllm", "worker-")):
            res = run_warmed(args, prompts, system)
        else:
            engine, mode = system.split("-", 1)
            res = run_ours(args, prompts, mode, "native" if engine == "native" else "vllm")
            res["tokens_per_s"] = res["generated_tokens"] / res["seconds"]
    except Exception as err:  # reported, not raised: the other systems still run
        res = dict(error=f"{type(err).__name__}: {err}"[:500])
    print("RESULT " + json.dumps(res), flush=True)
