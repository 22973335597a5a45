"""The report of a run: each system's median run, its ratios to stock vLLM inside the run, and the
workload."""
from __future__ import annotations

import json

from bench.peer.engines import kv_settings, on_cpu


def build_report(args, model: str, runs: dict[str, list[dict]], partial_out: str | None = None) -> dict:
    """The report of the runs so far; with partial_out, also written there as JSON (not printed)."""
    results = {system: median_run(rs) for system, rs in runs.items() if rs}
    for base in ("vllm", "vllm-batch-invariant"):  # ratios inside this one run
        base_tps = results.get(base, {}).get("tokens_per_s")
        for system, res in results.items():
            if base_tps and "tokens_per_s" in res:
                res[f"x_{base.replace('-', '_')}"] = round(res["tokens_per_s"] / base_tps, 3)
            if base == "vllm" and len(runs[system]) > 1 and base in runs:
                res.update(paired_ratios(runs[system], runs[base]))
    import torch
    report = dict(
        benchmark="peer_vllm", device="cpu" if on_cpu() else torch.cuda.get_device_name(), model=model,
        tensor_parallel_size=args.tensor_parallel_size, engine_core=args.engine_core, interleaved=args.interleave,
        workload=dict(prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                      stock_logprobs=args.stock_logprobs, logprobs_layout=args.logprobs_layout,
                      temperature=args.temperature, top_p=args.top_p, lora_rank=args.lora, **kv_settings(args)),
        ours=dict(window=args.window, group=args.group), results=results)
    if partial_out:
        report["complete"] = False
        with open(partial_out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def median_run(runs: list[dict]) -> dict:
    """One system's runs as one result: the median run by tokens/s (the first error if none ran),
    with every run's tokens/s in order when there were several."""
    ok = sorted((r for r in runs if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
    if not ok:
        return runs[0]
    out = dict(ok[(len(ok) - 1) // 2])
    if len(runs) > 1:
        out["runs_tokens_per_s"] = [round(r.get("tokens_per_s", float("nan")), 1) for r in runs]
    return out


def paired_ratios(runs: list[dict], base_runs: list[dict]) -> dict:
    """Each round's ratio to stock vLLM's run of the same round (the machine's drift between rounds
    falls out), and their median; a round where either run failed has none."""
    ratios = [round(r["tokens_per_s"] / b["tokens_per_s"], 3) for r, b in zip(runs, base_runs)
              if "tokens_per_s" in r and "tokens_per_s" in b]
    if not ratios:
        return {}
    return dict(rounds_x_vllm=ratios, x_vllm_rounds_median=round(median(ratios), 3))


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
