"""The quality study's plots: one PNG per quantity, each arm's mean over seeds by step with its min–max band; and
the canonical arm's reward minus each other arm's, paired by seed (reward_gap.png)."""
from __future__ import annotations

from pathlib import Path

# log-scaled quantities: zero stays visible next to tiny non-zero values
SYMLOG = {"rollout_train/kl", "rollout_train/max_abs_logprob_diff"}


def _figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt, *plt.subplots(figsize=(6, 3.8))


def _save(plt, fig, ax, title: str, path: Path) -> Path:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_quantities(curves: dict, quantities: list[str], out_dir: Path, setting: str) -> list[Path]:
    """curves: arm -> seed -> the run's step records. Returns the PNGs written, one per quantity."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key in quantities:
        plt, fig, ax = _figure()
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
        paths.append(_save(plt, fig, ax, f"{key} — {setting}", out_dir / (key.replace("/", "_") + ".png")))
    return paths


def plot_reward_gaps(curves: dict, out_dir: Path, setting: str, window: int = 5) -> Path:
    """reward_gap.png: for each arm, the canonical arm's reward minus that arm's, seed by seed (the same start and
    prompts), each seed's difference averaged over the last `window` steps (one step's reward is a noisy
    estimate); the mean over seeds with its min–max band, and the zero line. Above zero: canonical ahead. curves
    holds the canonical arm."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plt, fig, ax = _figure()
    ax.axhline(0.0, color="black", linewidth=0.8)
    for arm, by_seed in curves.items():
        if arm == "canonical":
            continue
        seeds = sorted(set(by_seed) & set(curves["canonical"]))
        steps = min(len(curves[a][s]) for a in ("canonical", arm) for s in seeds)
        gaps = [[curves["canonical"][s][i]["reward/mean"] - by_seed[s][i]["reward/mean"] for i in range(steps)]
                for s in seeds]
        smooth = [[sum(g[max(0, i - window + 1):i + 1]) / len(g[max(0, i - window + 1):i + 1]) for i in range(steps)]
                  for g in gaps]
        xs = list(range(1, steps + 1))
        line, = ax.plot(xs, [sum(c) / len(c) for c in zip(*smooth)], label=f"canonical − {arm} ({len(seeds)} seeds)")
        ax.fill_between(xs, [min(c) for c in zip(*smooth)], [max(c) for c in zip(*smooth)], color=line.get_color(),
                        alpha=0.15, linewidth=0)
    return _save(plt, fig, ax, f"reward gap, paired by seed, {window}-step mean — {setting}", out_dir / "reward_gap.png")
