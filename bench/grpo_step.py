"""GRPO step time, zero KL against the stock arm, on the same data, model, batch and optimizer; JSON.

    python -m bench.grpo_step --config recipes/configs/gpu_colocated.yaml --steps 11 --rounds 2
    python -m bench.grpo_step --config recipes/configs/gpu_split.yaml --steps 11
    python -m bench.grpo_step --steps 3 --rounds 1 --device cpu          # a smoke run of the tiny config
    python -m bench.grpo_step ... --arms canonical > a.json; ... --arms stock > b.json
    python -m bench.grpo_step --merge a.json b.json                      # one arm per call, joined
    python -m bench.grpo_step --config recipes/configs/gpu_colocated.yaml --steps 21 --interleave
    python -m bench.grpo_step --config recipes/configs/gpu_colocated.yaml --steps 6 --interleave \
        --plot-lengths lengths.png warmup.steps=0 train.prompts_per_step=64 model.max_positions=8192 \
        rollout.length_distribution=lognormal rollout.length_median=1024 rollout.max_tokens=4096 \
        trainer.batching.max_tokens_per_micro_batch=16384 trainer.batching.activation_checkpointing=true

Each round runs the recipe once per arm, taking turns (these machines are noisy), in the order given
in even rounds and in the reverse order in odd ones (`order` in each round): on GPUs the arm that
ran second was seen to run faster, so an even number of rounds pairs both orders. `canonical` (the
config as it is, KL 0) and `stock` (numerics=stock: the stock engine's rollouts, the unpatched model
under FSDP2 with SDPA, old log-probs recomputed, right-padded rows within the config's token budget and
activation checkpointing; see ARMS); `--arms canonical,async` adds `async` (train.async_steps=1:
the next step's rollouts generated while the trainer steps; split placement) and `async-in-flight` (the
same, its pushes landing in the rollouts in flight: native engines, object store). Per arm and round:
the median over the steps after the first (compiles, warm caches) of rollout, train, weight sync,
engine sleep and step seconds (checkpoint writes left out), rollout and train tokens/s, the
trainer's MFU and peak memory (GPU ranks only), the completions' median length and its spread, and
the largest KL and max |Δ log-prob| of any step; per round the paired ratios stock step / canonical
step (above 1: zero KL is faster), canonical / stock train tokens/s, and canonical step / async step
(the asynchronous speed-up), the same pairs of the steps after the first summed (`*_steps_summed`:
slow steps count there), and samples per second; per round, for the async arms, the seconds of steps
each arm took to reach the same reward (time_to_reward). Progress goes to stderr, the JSON to stdout;
--plot draws the split.

Completion lengths: rollout.length_distribution=lognormal gives each request its own max_tokens, drawn
as the recipe draws it (recipes.rollouts.completion_budget: median rollout.length_median, log-space
std rollout.length_sigma, capped at rollout.max_tokens). These benchmarks' random models almost
never emit EOS, so their completions run to the drawn budget, with one exception: the supervised
warm-up teaches the arithmetic answer and its EOS (about 3 tokens), hence warmup.steps=0 above.
--plot-lengths draws a histogram of the budgets the config draws for its steps (and puts their
summary in the JSON as `drawn_lengths`) before the runs start.

--interleave runs the arms' jobs side by side in this process, on the same GPUs, taking steps in turns
(step k of each arm, their order alternating from step to step), so that a machine that slows for
minutes slows both arms alike; each actor's resource share is halved for it. Each round then also has
the paired ratio of every step after the first (`*_per_step`) and its median. Only synchronous arms:
an async arm generates between its steps, into the other arm's.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.grpo_arms.lengths import drawn_lengths, length_summary, plot_lengths
from bench.grpo_arms.plot import plot
from bench.grpo_arms.ratios import merge, with_ratios
from bench.grpo_arms.run import ARMS, CPU_SMOKE, arm_overrides, run_arm, run_interleaved
from bench.grpo_arms.summary import summarise
from recipes.config import load_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="recipes/configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=11, help="per run; the first is left out of the medians")
    ap.add_argument("--rounds", type=int, default=1, help="odd rounds run the arms in reverse order")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the tiny config, a smoke run")
    ap.add_argument("--plot", default=None, help="a PNG of each arm's step split")
    ap.add_argument("--arms", default="canonical,stock",
                    help=f"the arms to run, in this order (one per call when a call's time is capped); of "
                         f"{', '.join(ARMS)}")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no runs: join earlier outputs of this benchmark (one arm each, the same config "
                         "and machine, run in turns) round by round, with their ratios")
    ap.add_argument("--interleave", action="store_true",
                    help="the arms side by side on the same GPUs, taking steps in turns (synchronous arms only)")
    ap.add_argument("--plot-lengths", default=None, metavar="PNG",
                    help="a histogram of the completion budgets (max_tokens) the config draws for its steps")
    ap.add_argument("overrides", nargs="*", help="key.sub=value, given to both arms")
    args = ap.parse_args()
    if args.merge and args.plot_lengths:
        ap.error("--plot-lengths draws a run's lengths: give it without --merge")
    if args.merge:
        result = merge([json.loads(Path(p).read_text()) for p in args.merge])
    else:
        arms = args.arms.split(",")
        unknown = sorted(set(arms) - set(ARMS))
        if unknown:
            ap.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
        if args.interleave and any(a.startswith("async") for a in arms):
            ap.error("--interleave: an async arm generates between its steps, into the other arm's; "
                     "run it without --interleave")
        extra = (CPU_SMOKE if args.device == "cpu" else []) + args.overrides
        result = {"config": args.config, "steps": args.steps, "overrides": args.overrides, "rounds": []}
        if args.plot_lengths:  # before the runs: the lengths are the config's, whatever the runs do
            cfg = load_config(args.config, arm_overrides(arms[0], args.steps, extra))
            lengths = drawn_lengths(cfg)
            plot_lengths(cfg, lengths, args.plot_lengths)
            result["drawn_lengths"] = length_summary(cfg, lengths)
        with tempfile.TemporaryDirectory(prefix="zerokl-bench-grpo-") as tmp:
            for i in range(args.rounds):
                order = arms if i % 2 == 0 else arms[::-1]
                row = {"order": order}
                if args.interleave:
                    records, gpus = run_interleaved(args.config, order, args.steps, extra, Path(tmp) / f"round-{i}")
                    row.update({"interleaved": True,
                                **{arm: {**summarise(records[arm]), "gpus": gpus[arm]} for arm in order}})
                else:
                    for arm in order:
                        row[arm] = summarise(run_arm(args.config, arm, args.steps, extra, Path(tmp) / f"{arm}-{i}"))
                        # each arm's figures as soon as it ends: a later arm that fails does not lose them
                        print(f"[bench] {arm} round {i}: {json.dumps(row[arm])}", file=sys.stderr, flush=True)
                result["rounds"].append(row)
        with_ratios(result)
    print(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
