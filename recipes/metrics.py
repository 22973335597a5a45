"""Per-step metrics: rollout-vs-train log-prob agreement, and logging to wandb and a local JSONL.

`rollout_train/kl` is the mean over generated tokens of (rollout log-prob - training log-prob), the
k1 estimate of KL(rollout || train) from rollout samples; `rollout_train/kl_k3` is the k3 estimate
mean(exp(r) - 1 - r) with r = train - rollout. Both are exactly 0.0 when every log-prob matches.
For MoE policies `rollout_train/routing_agreement` is the fraction of (generated token, MoE layer)
routing decisions (the set of k experts) that the rollout and the trainer's forward made identically
(1.0 = 100%), and `rollout_train/routing_mismatches` the count of the others; dense runs log neither.
"""
from __future__ import annotations

import json
import math
import netrc
import statistics
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .config import RecipeConfig

METRICS_FILE = "metrics.jsonl"


def logprob_agreement(rollout_lp: torch.Tensor, train_lp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Partial sums over the masked tokens of one batch; merge batches with `combine_agreement`."""
    diff = (rollout_lp.detach().float() - train_lp.detach().float())[mask.bool()].double()
    r = -diff
    return {"tokens": int(diff.numel()), "sum_diff": float(diff.sum()), "sum_k3": float((torch.expm1(r) - r).sum()),
            "max_abs": float(diff.abs().max()) if diff.numel() else 0.0, "mismatched": int((diff != 0).sum())}


def routing_agreement(rollout_experts: torch.Tensor, train_experts: torch.Tensor, mask: torch.Tensor) -> dict:
    """Partial sums over the masked tokens: (token, MoE layer) decisions, and those whose expert ids
    differ. Both [B, T-1, moe_layers, k] aligned like the log-probs (ids in increasing order)."""
    if rollout_experts.shape != train_experts.shape:
        raise ValueError(f"rollout routing {tuple(rollout_experts.shape)} != trainer routing "
                         f"{tuple(train_experts.shape)}")
    m = mask.bool()
    differ = (rollout_experts[m].long() != train_experts[m].long()).any(-1)  # [tokens, layers]
    return {"routing_decisions": int(differ.numel()), "routing_mismatches": int(differ.sum())}


def combine_agreement(parts: list[dict]) -> dict:
    tokens = sum(p["tokens"] for p in parts)
    return {
        "rollout_train/kl": sum(p["sum_diff"] for p in parts) / max(tokens, 1),
        "rollout_train/kl_k3": sum(p["sum_k3"] for p in parts) / max(tokens, 1),
        "rollout_train/max_abs_logprob_diff": max((p["max_abs"] for p in parts), default=0.0),
        "rollout_train/mismatched_tokens": sum(p["mismatched"] for p in parts),
        "rollout_train/tokens": tokens,
        **_combine_routing(parts),
    }


def _combine_routing(parts: list[dict]) -> dict:
    """The routing metrics when some part measured routing (an MoE run), else nothing."""
    if not any("routing_decisions" in p for p in parts):
        return {}
    decisions = sum(p.get("routing_decisions", 0) for p in parts)
    mismatches = sum(p.get("routing_mismatches", 0) for p in parts)
    return {"rollout_train/routing_agreement": (decisions - mismatches) / decisions if decisions else float("nan"),
            "rollout_train/routing_mismatches": mismatches}


def dvr_counters(rollouts) -> dict:
    """Decode-verify-rollback counters summed over a step's rollouts (Rollout.stats)."""
    keys = ("verify_windows", "rollbacks", "recomputed_tokens", "proposed_tokens", "accepted_tokens")
    totals = {k: sum(getattr(ro.stats, k, 0) for ro in rollouts) for k in keys}
    out = {f"dvr/{k}": v for k, v in totals.items()}
    out["dvr/acceptance_rate"] = (totals["accepted_tokens"] / totals["proposed_tokens"]
                                  if totals["proposed_tokens"] else float("nan"))
    return out


def step_metrics(rollouts, rewards: torch.Tensor, results: list[dict], loss_tokens: int, times: dict,
                 trainer_version: int | None = None) -> dict:
    """Everything logged for one step. results: the trainer ranks' train_step dicts; times: seconds
    of rollout (waited for), generate (when not the same), train and weight sync; trainer_version: the weight version the trainer stepped from
    (the rollouts' staleness is measured against it)."""
    gen_tokens = sum(len(ro.token_ids) for ro in rollouts)
    return {
        **ratio_spread([r["ratio"] for r in results]),
        **({} if trainer_version is None else staleness(rollouts, trainer_version)),
        **combine_agreement([p for r in results for p in r["agreement"]]),
        "reward/mean": float(rewards.mean()),
        "rollout/samples": len(rollouts),
        "reward/accuracy": float((rewards >= 1.0).float().mean()),
        "reward/solved_groups": float((rewards.max(dim=1).values >= 1.0).float().mean()),
        "response/length_mean": gen_tokens / len(rollouts),
        **length_spread([len(ro.token_ids) for ro in rollouts]),
        "response/stop_fraction": sum(ro.finish_reason == "stop" for ro in rollouts) / len(rollouts),
        **dvr_counters(rollouts),
        "train/loss": sum(r["loss_sum"] for r in results) / max(loss_tokens, 1),
        "train/clip_fraction": sum(r["clipped_tokens"] for r in results) / max(loss_tokens, 1),
        # the mean -log p of the sampled tokens under the trained policy: an estimate of its entropy
        "train/entropy": sum(r["entropy_sum"] for r in results) / max(loss_tokens, 1),
        # tokens left in the loss by trainer.loss.rollout_correction (token_mask drops some)
        "train/kept_fraction": sum(r["kept_tokens"] for r in results) / max(loss_tokens, 1),
        "train/grad_norm": results[0]["grad_norm"][-1],
        "perf/rollout_s": times["rollout"],  # what the step waited for its rollouts
        "perf/rollout_generate_s": times.get("generate", times["rollout"]),  # generating them (async: ahead)
        "perf/train_s": times["train"],
        "perf/weight_sync_s": times["sync"],
        "perf/sleep_s": times.get("sleep", 0.0),  # colocated: the engines releasing their memory
        "perf/rollout_tokens_per_s": gen_tokens / max(times.get("generate", times["rollout"]), 1e-9),
        "perf/train_tokens_per_s": sum(r["tokens"] for r in results) / max(times["train"], 1e-9),
        **train_device_metrics(results, times["train"]),
    }


# The H200's dense bf16 peak, the denominator of the trainer's MFU (a reference figure, not measured here).
H200_BF16_FLOPS = 790e12


def train_device_metrics(results: list[dict], train_seconds: float) -> dict:
    """GPU ranks only: the largest rank's peak allocated memory in the train step, MFU (the model FLOPs of a
    forward and backward per trained token, 6 x parameters, over the ranks' bf16 peak), the allocator's
    device allocations and retries, and the GPUs' SM clock, power and temperature while they trained."""
    peak = max((r.get("peak_memory_bytes", 0) for r in results), default=0)
    if not peak:
        return {}
    flops = 6 * results[0]["num_params"] * sum(r["tokens"] for r in results) / max(train_seconds, 1e-9)
    out = {"perf/train_peak_memory_gib": peak / 2 ** 30,
           "perf/train_mfu": flops / (H200_BF16_FLOPS * len(results)),
           # the ranks' cudaMalloc calls and full-device retries in the step (recipes.step_memory.allocator_counts)
           "perf/train_device_allocs": sum(r.get("device_allocs", 0) for r in results),
           "perf/train_alloc_retries": sum(r.get("alloc_retries", 0) for r in results)}
    clocks = [r["gpu_clocks"] for r in results if r.get("gpu_clocks")]  # recipes.gpu_clocks: where nvidia-smi is
    if clocks:  # the slowest rank's GPU sets the step's pace
        out["perf/train_sm_clock_mhz"] = min(c["sm_clock_mhz"] for c in clocks)
        out["perf/train_sm_clock_mhz_min"] = min(c["sm_clock_mhz_min"] for c in clocks)
        out["perf/train_gpu_power_w"] = max(c["power_w"] for c in clocks)
        out["perf/train_gpu_temperature_c"] = max(c["temperature_c_max"] for c in clocks)
    return out


def length_spread(lengths: list[int]) -> dict:
    """The spread of a step's completion lengths (generated tokens per rollout): median, min, max."""
    return {"response/length_median": statistics.median(lengths), "response/length_min": min(lengths),
            "response/length_max": max(lengths)}


def ratio_spread(parts: list[dict]) -> dict:
    """The importance ratio (current policy over the log-probs the loss divides by) over the step's loss
    tokens, from the ranks' train_step "ratio" parts."""
    count = sum(p["count"] for p in parts)
    if not count:
        return {}
    return {"train/importance_ratio_min": min(p["min"] for p in parts),
            "train/importance_ratio_mean": sum(p["sum"] for p in parts) / count,
            "train/importance_ratio_max": max(p["max"] for p in parts)}


def staleness(rollouts, trainer_version: int) -> dict:
    """How many weight versions behind the trainer's each generated token was sampled: mean, max."""
    behind = [trainer_version - v for ro in rollouts for v in (ro.weight_versions or [])]
    if not behind:
        return {}
    return {"async/staleness_mean": sum(behind) / len(behind), "async/staleness_max": max(behind)}


def step_line(metrics: dict) -> str:
    """A step's headline numbers, as printed while a run goes."""
    routing = metrics.get("rollout_train/routing_agreement")
    return (f"reward {metrics['reward/mean']:.3f}  kl {metrics['rollout_train/kl']:.3g}  "
            f"max|Δ| {metrics['rollout_train/max_abs_logprob_diff']:.3g}  "
            f"mismatched {metrics['rollout_train/mismatched_tokens']}  "
            + ("" if routing is None else
               f"routing {routing:.2%} ({metrics['rollout_train/routing_mismatches']} differ)  ")
            + f"{metrics['perf/step_s']:.1f}s (rollout {metrics['perf/rollout_s']:.1f}s, "
              f"train {metrics['perf/train_s']:.1f}s, sync {metrics['perf/weight_sync_s']:.2f}s)")


STEP_PARTS = ("rollout", "train", "weight_sync", "sleep")


def step_medians(records: list[dict]) -> dict:
    """Median seconds of each STEP_PARTS entry and of the step (checkpoint writes left out), over the
    steps after the first (it compiles and warms caches) when there are more."""
    steady = records[1:] or records
    med = {k: statistics.median(r[f"perf/{k}_s"] for r in steady) for k in STEP_PARTS}
    med["step"] = statistics.median(r["perf/step_s"] - r.get("perf/checkpoint_s", 0.0) for r in steady)
    return med


def step_split(records: list[dict]) -> str:
    """Where a run's steps went (step_medians), as printed at its end."""
    steady = records[1:] or records
    med = step_medians(records)
    share = med["weight_sync"] / med["step"] if med["step"] else 0.0
    return (f"median step over {len(steady)} step(s){' after the first' if len(records) > 1 else ''}: "
            f"{med['step']:.2f}s = rollout {med['rollout']:.2f}s + train {med['train']:.2f}s + "
            f"weight sync {med['weight_sync']:.2f}s ({share:.1%})"
            + (f" + engine sleep {med['sleep']:.2f}s" if med["sleep"] else "") + " + the rest")


class StepProgress:
    """A run's tqdm progress bar. On a terminal it is redrawn in place below one metrics line per step.
    Elsewhere (`ray job submit`, which streams the job's log and turns every '\\r' redraw into a line of its
    own; a pipe; a file) it is printed once per step, as one finished line that ends with the step's metrics."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", enabled: bool = True):
        self._tqdm, self.total, self.initial, self.desc, self.enabled = tqdm, total, initial, desc, enabled
        self._start = time.perf_counter()
        interactive = sys.stdout.isatty() and sys.stderr.isatty()
        self._bar = (tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
                     if enabled and interactive else None)

    def step(self, step: int, metrics: dict) -> None:
        line = step_line(metrics)
        if self._bar is not None:
            self._bar.write(f"step {step}/{self.total}  {line}")  # history above the bar
            self._bar.update(step - self._bar.n)
        elif self.enabled:
            meter = self._tqdm.format_meter(step, self.total, time.perf_counter() - self._start, prefix=self.desc,
                                            unit="step", initial=self.initial, postfix=line)
            print(meter, flush=True)
        else:
            print(f"step {step}/{self.total}  {line}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def wandb_mode(configured: str | None = None) -> str:
    """Explicit setting, else WANDB_MODE, else online only when an API key is available."""
    if configured:
        return configured
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


class MetricsLogger:
    """Appends one JSON object per step to <run_dir>/metrics.jsonl and logs the numbers to wandb."""

    def __init__(self, run_dir: str | Path, cfg: RecipeConfig, run_name: str):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._wandb = None
        if cfg.metrics.wandb:
            mode = wandb_mode(cfg.metrics.wandb_mode)
            if mode != "disabled":
                import wandb
                self._wandb = wandb.init(project=cfg.metrics.wandb_project, name=run_name,
                                         dir=str(self.run_dir), config=cfg.to_dict(), mode=mode)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")
        if self._wandb is not None:
            numbers = {k: v for k, v in metrics.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of <run_dir>/metrics.jsonl; a step logged twice (a resumed run) keeps the last."""
    by_step: dict[int, dict] = {}
    with open(Path(run_dir) / METRICS_FILE) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]
