"""The quality study's plots: one PNG per quantity, each arm's mean over seeds by step with its min–max band."""
from __future__ import annotations

from pathlib import Path

# log-scaled quantities: zero stays visible next to tiny non-zero values
SYMLOG = {"rollout_train/kl", "rollout_train/max_abs_logprob_diff"}


def plot_quantities(curves: dict, quantities: list[str], out_dir: Path, setting: str) -> list[Path]:
    """curves: arm -> seed -> the run's step records. Returns the PNGs written, one per quantity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key in quantities:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for arm, by_seed in curves.items():
            series = [[r.get(key) for r in records] for records in by_seed.values()]
            steps = min(len(s) for s in series)
            columns = [[s[i] for s in series if s[i] is not None] for i in range(steps)]
            xs = [i + 1 for i, c in enumerate(columns) if c]
            columns = [c for c in columns if c]
            if not columns:
                continue
            mean = [sum(c) / len(c) for c in columns]
            line, = ax.plot(xs, mean, label=f"{arm} ({len(series)} seeds)")
            ax.fill_between(xs, [min(c) for c in columns], [max(c) for c in columns], color=line.get_color(),
                            alpha=0.2, linewidth=0)
        if key in SYMLOG:
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_title(f"{key} — {setting}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / (key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
