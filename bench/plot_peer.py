"""Plot bench/peer_vllm.py results: each system's tokens/s as a multiple of stock vLLM in the same run,
one group of bars per result file; a system that failed in a run is marked "failed" in its slot. For
--interleave runs each pass's ratio to stock's pass of the same turn is a dot on its system's bar, so
the host's noise from pass to pass shows beside the median.

    python -m bench.plot_peer bench/results/2026-11-25/*.json --out peer.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _label(doc: dict, path: Path) -> str:
    w = doc["workload"]
    return f"{path.stem}\n{w['prompts']} x {w['prompt_len']} / {w['max_tokens']}"


def plot(paths: list[Path], out: Path) -> Path:
    fig = figure(paths)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def figure(paths: list[Path]):
    """The bars (and an interleaved run's paired passes) of these result files, not yet saved."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(p.read_text()) for p in paths]
    systems = sorted({s for d in docs for s, r in d["results"].items() if s != "vllm"})
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(max(7.0, 2.8 * len(docs)), 4.0))
    for k, system in enumerate(systems):
        slots = [(i + (k - (len(systems) - 1) / 2) * width, d["results"].get(system)) for i, d in enumerate(docs)]
        ran = [(x, r["x_vllm"]) for x, r in slots if r is not None and "x_vllm" in r]
        bars = ax.bar([x for x, _ in ran], [y for _, y in ran], width, label=system)
        paired = [(x, ratio) for x, r in slots if r is not None for ratio in r.get("passes_x_vllm", [])]
        if paired:
            ax.scatter([x for x, _ in paired], [y for _, y in paired], s=6, color="black", zorder=3,
                       label=None if ax.collections else "paired passes")  # one legend entry
        for x, r in slots:  # a system that failed in a run keeps its slot, marked
            if r is not None and "error" in r:
                ax.text(x, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=6,
                        color=bars.patches[0].get_facecolor() if bars.patches else "black")
    ax.axhline(1.0, color="black", linewidth=0.8)  # stock vLLM in the same run
    ax.set_xticks(range(len(docs)), [_label(d, p) for d, p in zip(docs, paths)], fontsize=7)
    ax.set_ylabel("tokens/s, x stock vLLM (same run)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="peer_vllm JSON files")
    p.add_argument("--out", type=Path, default=Path("peer.png"))
    args = p.parse_args()
    print(plot(args.results, args.out))


if __name__ == "__main__":
    main()
