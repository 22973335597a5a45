"""bench.verl_grpo's documents as one PNG: each arm's step split into verl's phases, per shape and round.

    python -m bench.verl_plot verl_quickstart_64.json verl_qwen15b_16.json --out verl_steps.png

A bar is an arm's median step after the first (the lower middle one of an even count: a step that ran), split
into verl's own timers at that step (`timing_s/*`: gen, old_log_prob, ref, update_actor, ...); what the named
timers do not cover is "other".
"""
from __future__ import annotations

import argparse
import json
import statistics

# verl's timers a step is split into, in the order verl runs them
PHASES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights")


def step_split(arm: dict) -> dict[str, float]:
    """Seconds of each phase at the arm's median step after the first (the first alone where there is one step),
    and "other": the step's seconds the phases leave."""
    steps = arm["timing_s"]["step"]
    later = list(range(1, len(steps))) or [0]
    median = statistics.median_low([steps[i] for i in later])
    index = next(i for i in later if steps[i] == median)
    split = {phase: arm["timing_s"][phase][index] or 0.0 for phase in PHASES if phase in arm["timing_s"]}
    split["other"] = max(0.0, steps[index] - sum(split.values()))
    return split


def bars(docs: list[dict]) -> list[tuple[str, dict[str, float]]]:
    """(label, split) per shape, round and arm, in the order each round ran its arms."""
    out = []
    for doc in docs:
        prompts = doc["settings"]["train_batch_size"]
        for r, row in enumerate(doc["rounds"]):
            for arm in row["order"]:
                if arm in row:
                    out.append((f"{doc['shape']} ({prompts} prompts)\n{arm}, round {r}", step_split(row[arm])))
    return out


def plot(docs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = bars(docs)
    labels = [label for label, _ in rows]
    fig, ax = plt.subplots(figsize=(2.2 * len(rows) + 2, 4.5))
    bottom = [0.0] * len(rows)
    for phase in (*PHASES, "other"):
        values = [split.get(phase, 0.0) for _, split in rows]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.1f} s", (x, total), ha="center", va="bottom")
    ax.set_ylabel("seconds per verl step (median after the first)")
    ax.set_title(f"verl {docs[0]['verl']} GRPO step, split by verl's timers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("docs", nargs="+", help="bench.verl_grpo JSON documents")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    docs = []
    for path in args.docs:
        with open(path) as f:
            docs.append(json.load(f))
    plot(docs, args.out)


if __name__ == "__main__":
    main()
