"""The paired ratios of a run's rounds (per round, per step when interleaved, and their medians), and
earlier outputs joined round by round."""
from __future__ import annotations

import statistics

from bench.grpo_arms.run import ARMS
from bench.grpo_arms.summary import time_to_reward

# (numerator arm, denominator arm) of each paired ratio of step times, per round
RATIOS = {"stock_over_canonical_step": ("stock", "canonical"),
          "canonical_over_async_step": ("canonical", "async"),
          "canonical_over_async_in_flight_step": ("canonical", "async-in-flight")}
# (numerator arm, denominator arm) of each paired ratio of train tokens/s, per round (above 1: the
# numerator's trainer is faster)
TOKEN_RATIOS = {"canonical_over_stock_train_tokens_per_s": ("canonical", "stock")}


def with_ratios(result: dict) -> dict:
    """Each round's RATIOS where it has both arms, and their medians."""
    for row in result["rounds"]:
        for num, den in (pair for pair in RATIOS.values() if pair[1].startswith("async")):
            reached = time_to_reward(row, (num, den))
            if reached is not None:
                row[f"time_to_reward_{num}_vs_{den}"] = reached
    for name, (num, den) in RATIOS.items():
        summed = name.removesuffix("_step") + "_steps_summed"  # the same pair, of steps_after_first_s
        # interleaved rounds: step k of one arm against step k of the other
        per_step = name.removesuffix("_step") + "_per_step"
        for row in result["rounds"]:
            if num in row and den in row:
                row[name] = row[num]["step_s"] / row[den]["step_s"]
                if row[num].get("steps_after_first_s") and row[den].get("steps_after_first_s"):  # 0: one step
                    row[summed] = row[num]["steps_after_first_s"] / row[den]["steps_after_first_s"]
                if row.get("interleaved"):
                    row[per_step] = [n / d for n, d in zip(row[num]["step_seconds"][1:], row[den]["step_seconds"][1:])]
                    row[f"{per_step}_median"] = statistics.median(row[per_step])
        for key in (name, summed):
            ratios = [r[key] for r in result["rounds"] if key in r]
            if ratios:
                result[f"{key}_median"] = statistics.median(ratios)
        pooled = [ratio for r in result["rounds"] for ratio in r.get(per_step, [])]
        if pooled:  # every round's steps
            result[f"{per_step}_median"] = statistics.median(pooled)
    for name, (num, den) in TOKEN_RATIOS.items():
        per_step = f"{name}_per_step"
        for row in result["rounds"]:
            if "train_tokens_per_s" in row.get(num, {}) and "train_tokens_per_s" in row.get(den, {}):
                row[name] = row[num]["train_tokens_per_s"] / row[den]["train_tokens_per_s"]
                if row.get("interleaved"):
                    row[per_step] = [n / d for n, d in zip(row[num]["train_tokens_per_s_by_step"][1:],
                                                           row[den]["train_tokens_per_s_by_step"][1:])]
        ratios = [r[name] for r in result["rounds"] if name in r]
        if ratios:
            result[f"{name}_median"] = statistics.median(ratios)
        pooled = [ratio for r in result["rounds"] for ratio in r.get(per_step, [])]
        if pooled:
            result[f"{per_step}_median"] = statistics.median(pooled)
    return result


def merge(parts: list[dict]) -> dict:
    """Outputs of runs with other arms (--arms), joined round by round; they must share config, steps
    and overrides, and no arm may appear twice in a round."""
    keys = {(p["config"], p["steps"], tuple(p["overrides"])) for p in parts}
    if len(keys) != 1:
        raise ValueError(f"--merge: the runs differ in config, steps or overrides: {sorted(keys)}")
    result = {k: parts[0][k] for k in ("config", "steps", "overrides")}
    result["rounds"] = []
    for i in range(max(len(p["rounds"]) for p in parts)):
        row = {}
        for p in parts:
            for arm, figures in (p["rounds"][i] if i < len(p["rounds"]) else {}).items():
                if arm not in ARMS:
                    continue
                if arm in row:
                    raise ValueError(f"--merge: arm {arm!r} appears twice in round {i}")
                row[arm] = figures
        result["rounds"].append(row)
    return with_ratios(result)
