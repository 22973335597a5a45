"""Render a run's curves to PNG: rollout/train KL (k1, k3), max |delta log-prob| and reward, with an
optional baseline run overlaid.

    python -m recipes.plot RUN [--baseline RUN] [--out curves.png] [--config CONFIG]

RUN is a run directory or a run's name, looked up under the output_dir of CONFIG (default: the recipe's
default, ~/zerokl-runs).
"""
from __future__ import annotations

import argparse
import difflib
import sys
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


class RunNotFound(Exception):
    """A run that is neither a directory nor a run's name under the runs directory."""


def find_run(run: str, runs_dir: Path) -> Path:
    """`run` if it is a directory, else the run of that name under `runs_dir`; RunNotFound names the
    runs whose names are close (or start with `run`), never picks one: a wrong run's curves mislead."""
    if Path(run).expanduser().is_dir():
        return Path(run).expanduser()
    if (runs_dir / run).is_dir():
        return runs_dir / run
    names = sorted(p.name for p in runs_dir.iterdir() if p.is_dir()) if runs_dir.is_dir() else []
    close = [n for n in names if n.startswith(run)] + difflib.get_close_matches(run, names, n=5, cutoff=0.6)
    close = list(dict.fromkeys(close))[:10]
    where = f"under {runs_dir}" if runs_dir.is_dir() else f"({runs_dir} does not exist)"
    if close:
        hint = f"; close matches: {', '.join(close)}"
    else:
        hint = f"; runs there: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}" if names else ""
    raise RunNotFound(f"no run '{run}': not a directory, nor a run's name {where}{hint}")


def runs_dir_of(config: str | None) -> Path:
    """Where runs are found by name: the config's output_dir, or the recipe's default one."""
    from .config import RecipeConfig, load_config
    output_dir = load_config(config).output_dir if config else RecipeConfig().output_dir
    return Path(output_dir).expanduser()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m recipes.plot", description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run directory or a run's name")
    ap.add_argument("--baseline", default=None, help="a run to overlay (e.g. one with --determinism off)")
    ap.add_argument("--out", default=None, help="PNG path (default: RUN/curves.png)")
    ap.add_argument("--config", default=None, help="find run names under this config's output_dir "
                                                   "(default: ~/zerokl-runs)")
    args = ap.parse_args(argv)
    try:
        runs_dir = runs_dir_of(args.config)
        run = find_run(args.run, runs_dir)
        baseline = find_run(args.baseline, runs_dir) if args.baseline else None
    except (RunNotFound, ValueError) as e:  # ValueError: the config's ConfigError
        print(f"{ap.prog}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    out = plot_runs(run, args.out or run / "curves.png", baseline)
    print(out)


if __name__ == "__main__":
    main()
