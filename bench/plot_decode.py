"""Plot `bench/kernels.py --only decode` results: each decode case's time as launched, as a multiple
of vLLM's FA3 on the same cache, one series of bars per result file (e.g. before and after a change
to the decode schedule).

    python -m bench.plot_decode before.json after.json --label before --label after --out decode.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _case(row: dict) -> str:
    return f"{row['batch']} x {row['context']}\n{row['q_heads']}q / {row['kv_heads']}kv"


def plot(paths: list[Path], out: Path, labels: list[str] | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [p.stem for p in paths]
    if len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} files")
    runs = [(name, json.loads(p.read_text())["decode_attention"]) for name, p in zip(labels, paths)]
    cases = [_case(r) for r in runs[0][1]]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cases)), 4.0))
    for k, (name, rows) in enumerate(runs):
        ratios = {_case(r): r["as_launched_over_fa3"] for r in rows if "as_launched_over_fa3" in r}
        xs = [i + (k - (len(runs) - 1) / 2) * width for i, c in enumerate(cases) if c in ratios]
        ax.bar(xs, [ratios[c] for c in cases if c in ratios], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), cases, fontsize=8)
    ax.set_ylabel("canonical decode time / FA3")
    ax.set_title("One decode step, 16-token pages (lower is faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("decode_attention.png"))
    p.add_argument("--label", action="append", help="a series name, once per file (default: file names)")
    args = p.parse_args()
    print(plot(args.files, args.out, args.label))


if __name__ == "__main__":
    main()
