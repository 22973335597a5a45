"""A run's figure: each arm's step split, reward against seconds of steps, and interleaved step times."""
from __future__ import annotations

from bench.grpo_arms.run import ARMS
from bench.grpo_arms.summary import REWARD_WINDOW, smoothed
from recipes.metrics import STEP_PARTS


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rounds = result["rounds"]
    labels = [f"{arm} r{i}" for i, r in enumerate(rounds) for arm in r if arm in ARMS]
    # a curve shorter than the smoothing window has no point to draw: runs of a few steps get no panel
    curves = [(f"{arm} r{i}", r[arm]["reward_curve"]) for i, r in enumerate(rounds) for arm in r
              if arm in ARMS and len(r[arm].get("reward_curve", [])) >= REWARD_WINDOW]
    # interleaved rounds: each arm's step seconds, step by step (the pairs the per-step ratios divide)
    turns = [(f"{arm} r{i}", r[arm]["step_seconds"]) for i, r in enumerate(rounds) if r.get("interleaved")
             for arm in r["order"]]
    panels = 1 + bool(curves) + bool(turns)
    fig, axes = plt.subplots(1, panels, figsize=(max(6.0, 1.6 * len(labels) + 2) + 6 * (panels - 1), 4), squeeze=False)
    ax = axes[0][0]
    bottom = [0.0] * len(labels)
    for part in STEP_PARTS:
        vals = [r[arm][f"{part}_s"] for r in rounds for arm in r if arm in ARMS]
        ax.bar(labels, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    rest = [r[arm]["step_s"] - b for (r, arm), b in zip([(r, a) for r in rounds for a in r if a in ARMS], bottom)]
    ax.bar(labels, rest, bottom=bottom, label="other")
    ax.set_ylabel("seconds per GRPO step (median)")
    ax.set_title(f"{result['config']}: step split per arm")
    ax.legend()
    if curves:  # reward against the seconds of steps after the first: time to the same reward
        ax = axes[0][1]
        for label, curve in curves:
            points = smoothed(curve)
            ax.plot([t for t, _ in points], [r for _, r in points], marker="o", label=label)
        ax.set_xlabel("seconds of steps after the first")
        ax.set_ylabel(f"reward, mean of the last {REWARD_WINDOW} steps")
        ax.legend()
    if turns:
        ax = axes[0][-1]
        for label, seconds in turns:
            ax.plot(range(1, len(seconds) + 1), seconds, marker="o", label=label)
        ax.set_xlabel("step (the arms in turns)")
        ax.set_ylabel("step seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
