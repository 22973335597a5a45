"""Render a run's curves to PNG: rollout/train KL (k1, k3), max |delta log-prob| and reward, with an
optional baseline run overlaid.

    python -m recipes.plot RUN_DIR [--baseline RUN_DIR] --out curves.png
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .metrics import read_metrics

PANELS = [
    ("rollout_train/kl", "KL(rollout || train), k1 (signed)", True),
    ("rollout_train/kl_k3", "KL(rollout || train), k3", True),
    ("rollout_train/max_abs_logprob_diff", "max |Δ log-prob|", True),
    ("reward/mean", "reward (mean)", False),
]


def plot_runs(run_dir: str | Path, out: str | Path, baseline: str | Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(run_dir), "deterministic", "-")]
    if baseline is not None:
        runs.append((Path(baseline), "baseline (determinism off)", "--"))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS), 3.6))
    for ax, (key, title, symlog) in zip(axes, PANELS):
        for path, label, style in runs:
            records = [r for r in read_metrics(path) if key in r]
            ax.plot([r["step"] for r in records], [r[key] for r in records], style, marker=".", label=label)
        if symlog:  # zero stays visible next to tiny non-zero values
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--baseline", default=None, help="a run to overlay (e.g. one with --determinism off)")
    ap.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    out = plot_runs(args.run_dir, args.out or Path(args.run_dir) / "curves.png", args.baseline)
    print(out)


if __name__ == "__main__":
    main()
