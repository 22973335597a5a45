"""One arm's run in figures: medians of the steps after the first, the largest mismatch, and its reward
over the seconds of its steps."""
from __future__ import annotations

import statistics

from recipes.metrics import step_medians

# the trainer's device figures (recipes.metrics.train_device_metrics): logged by GPU ranks only
DEVICE_FIGURES = {"train_mfu": "perf/train_mfu", "train_peak_memory_gib": "perf/train_peak_memory_gib",
                  "train_device_allocs": "perf/train_device_allocs", "train_alloc_retries": "perf/train_alloc_retries",
                  "train_sm_clock_mhz": "perf/train_sm_clock_mhz", "train_gpu_power_w": "perf/train_gpu_power_w",
                  "train_gpu_temperature_c": "perf/train_gpu_temperature_c"}
REWARD_WINDOW = 3  # steps in the trailing mean that time-to-reward compares (rewards are noisy step to step)


def summarise(records: list[dict]) -> dict:
    steady = records[1:] or records
    out = {f"{part}_s": seconds for part, seconds in step_medians(records).items()}
    out["rollout_tokens_per_s"] = statistics.median(r["perf/rollout_tokens_per_s"] for r in steady)
    out["train_tokens_per_s"] = statistics.median(r["perf/train_tokens_per_s"] for r in steady)
    out["train_tokens_per_s_by_step"] = [r["perf/train_tokens_per_s"] for r in records]
    for name, key in DEVICE_FIGURES.items():
        values = [r[key] for r in steady if key in r]
        if values:
            out[name] = statistics.median(values)
    if all("response/length_median" in r for r in steady):  # generated tokens per rollout
        out["completion_length_median"] = statistics.median(r["response/length_median"] for r in steady)
        out["completion_length_mean"] = statistics.median(r["response/length_mean"] for r in steady)
        out["completion_length_min"] = min(r["response/length_min"] for r in steady)
        out["completion_length_max"] = max(r["response/length_max"] for r in steady)
        out["stop_fraction"] = statistics.median(r["response/stop_fraction"] for r in steady)
    out["sync_share"] = out["weight_sync_s"] / out["step_s"]
    phases = sorted({k for r in steady for k in r if k.startswith("perf/sync_")})  # where the sync went
    out["sync_phases_s"] = {k[len("perf/sync_"):-2]: statistics.median(r.get(k, 0.0) for r in steady) for k in phases}
    out["max_kl"] = max(abs(r["rollout_train/kl"]) for r in records)
    out["max_abs_logprob_diff"] = max(r["rollout_train/max_abs_logprob_diff"] for r in records)
    out["reward_first_last"] = [records[0]["reward/mean"], records[-1]["reward/mean"]]
    out["steps"] = len(records)
    seconds = [r["perf/step_s"] - r.get("perf/checkpoint_s", 0.0) for r in records]
    out["samples_per_s"] = statistics.median(r["rollout/samples"] / s for r, s in zip(steady, seconds[-len(steady):]))
    # seconds of the steps after the first (it compiles and warms caches, as in the medians) up to each step
    elapsed = [sum(seconds[1:i + 1]) for i in range(len(seconds))]
    out["reward_curve"] = [[round(t, 4), r["reward/mean"]] for t, r in zip(elapsed, records)]
    out["step_seconds"] = seconds
    # all of them, summed: a few slow steps (a new shape compiled) move it, and not the median
    out["steps_after_first_s"] = elapsed[-1]
    return out


def smoothed(curve: list[list[float]], width: int = REWARD_WINDOW) -> list[tuple[float, float]]:
    """(elapsed seconds, mean reward of the last `width` steps) from each step on where there are `width`."""
    return [(curve[i][0], statistics.fmean(r for _, r in curve[i + 1 - width:i + 1]))
            for i in range(width - 1, len(curve))]


def time_to_reward(row: dict, arms: tuple[str, str]) -> dict | None:
    """Seconds of steps each arm took to reach the same reward: the lower of the two arms' last smoothed
    reward (both reached it), as the first step where an arm's smoothed reward is at or above it."""
    if not all(a in row and len(row[a].get("reward_curve", [])) >= REWARD_WINDOW for a in arms):
        return None
    curves = {a: smoothed(row[a]["reward_curve"]) for a in arms}
    target = min(c[-1][1] for c in curves.values())
    reached = {a: next(t for t, r in c if r >= target) for a, c in curves.items()}
    return {"target_reward": target, **{f"{a}_s": reached[a] for a in arms},
            f"{arms[0]}_over_{arms[1]}": reached[arms[0]] / reached[arms[1]]}
