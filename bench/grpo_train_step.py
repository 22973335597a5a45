"""The recipe's train step alone: one TrainerRank (FSDP2 on one rank, AdamW, the clipped GRPO loss) at the
recipe's batch shape, the canonical arm against the stock arm; prints JSON.

    python -m bench.grpo_train_step --model qwen1.5b --rounds 2 --profile out/   # one GPU
    python -m bench.grpo_train_step --model tiny --device cpu --steps 2          # a smoke run

The arms are the recipe's: canonical (the patched forward, log-probs from the rollouts, so one forward
and one backward) and stock (the unpatched model with SDPA, old log-probs recomputed: one more
no-grad forward). Each arm runs in a process of its own (one torch.distributed group each), the arms
in turns, `--rounds` times (machines are noisy). A batch is `--prompts` groups of `--group` rollouts,
prompts of 7-11 tokens and completions of 4-16, as the GPU recipe's arithmetic task gives. Per arm:
the median seconds of a step after warm-up (the device waited for); with `--profile DIR`, one more
step under torch.profiler, its tables in DIR/train_step_<arm>.txt and its host and device totals in
the JSON (a step whose device time is well under its seconds is bound by the host).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import torch

ARMS = ("canonical", "stock")


def batch(vocab: int, prompts: int, group: int, seed: int = 0):
    from recipes.batch import Sample, split_for_ranks
    rng = random.Random(seed)
    top = min(vocab, 1000)
    samples = []
    for _ in range(prompts):
        prompt = [rng.randrange(1, top) for _ in range(rng.randrange(7, 12))]
        for _ in range(group):
            n = rng.randrange(4, 17)
            samples.append(Sample(prompt, [rng.randrange(1, top) for _ in range(n)], [-1.0] * n,
                                  rng.uniform(-1.0, 1.0)))
    return split_for_ranks(samples, world=1, mini_batches=1)


def run_arm(args) -> dict:
    """This process: one arm's trainer rank, its warm-up steps, timed steps and optional profile."""
    from bench.rollout import build_model
    from recipes.config import TrainerConfig
    from recipes.trainer import TrainerRank
    device = torch.device(args.device)
    cfg = TrainerConfig(num_ranks=1, device=args.device, lr=1e-5,
                        old_logprobs="rollout" if args.arm == "canonical" else "recompute")
    rank = TrainerRank(0, 1, cfg, temperature=1.0, numerics=args.arm)
    model = build_model(args.model, args.device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank.setup("127.0.0.1", port, model)
    plans, tokens = batch(model.config.vocab_size, args.prompts, args.group)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> float:
        start = time.perf_counter()
        rank.train_step(plans[0], tokens)
        sync()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    seconds = [step() for _ in range(args.steps)]
    out = {"arm": args.arm, "seconds": seconds, "median_s": statistics.median(seconds)}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            out["profiled_step_s"] = step()
        events = prof.key_averages()
        out["host_self_s"] = sum(e.self_cpu_time_total for e in events) / 1e6
        out["device_self_s"] = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e6
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        with open(os.path.join(args.profile, f"train_step_{args.arm}.txt"), "w") as f:
            f.write(events.table(sort_by=sort, row_limit=40, max_name_column_width=70))
            f.write("\n\nBy host time\n")
            f.write(events.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))
    rank.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen1.5b", help="a bench.rollout shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm and round")
    ap.add_argument("--rounds", type=int, default=1, help="both arms in turn, this many times")
    ap.add_argument("--profile", default=None, help="a directory: one profiled step per arm (last round)")
    ap.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)  # a child process's arm
    args = ap.parse_args()
    if args.arm is not None:
        print(json.dumps(run_arm(args)))
        return
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for arm in ARMS:
            cmd = [sys.executable, "-m", "bench.grpo_train_step", "--arm", arm, "--model", args.model,
                   "--device", args.device, "--prompts", str(args.prompts), "--group", str(args.group),
                   "--warmup", str(args.warmup), "--steps", str(args.steps)]
            if args.profile and r == args.rounds - 1:
                cmd += ["--profile", args.profile]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"arm {arm} failed:\n{proc.stderr[-3000:]}")
            row[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"[bench] round {r} {arm}: {row[arm]['median_s']:.3f} s a step", file=sys.stderr, flush=True)
        row["stock_over_canonical"] = row["stock"]["median_s"] / row["canonical"]["median_s"]
        rounds.append(row)
    ratios = [r["stock_over_canonical"] for r in rounds]
    print(json.dumps({"model": args.model, "device": args.device, "prompts": args.prompts, "group": args.group,
                      "rounds": rounds, "stock_over_canonical_median": statistics.median(ratios)}, indent=1))


if __name__ == "__main__":
    main()
