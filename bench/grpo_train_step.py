"""The recipe's train step alone: one TrainerRank (FSDP2 on one rank, AdamW, the clipped GRPO loss) at the
recipe's batch shape, the canonical arm against the stock arm, and packed micro-batches against padded
ones on the same batch; prints JSON.

    python -m bench.grpo_train_step --model qwen1.5b --rounds 2 --profile out/   # one GPU
    python -m bench.grpo_train_step --model tiny --device cpu --steps 2          # a smoke run
    python -m bench.grpo_train_step --model qwen1.5b --arms canonical --rounds 2 --prompts 64 --group 8 \\
        --lengths lognormal --median 1024 --sigma 0.7 --cap 4096 --max-tokens-per-micro-batch 16384 \\
        --activation-checkpointing --layouts packed,padded                      # packing alone

The arms are the recipe's: canonical (the patched forward, log-probs from the rollouts, so one forward
and one backward) and stock (the unpatched model with SDPA, old log-probs recomputed: one more
no-grad forward). Each arm runs in a process of its own (one torch.distributed group each), the arms
in turns, `--rounds` times (machines are noisy), in the order given in even rounds and reversed in odd
ones.

A batch is `--prompts` groups of `--group` rollouts with prompts of 7-11 tokens. Completions:
`--lengths arithmetic` (the default) 4-16 tokens, as the GPU recipe's arithmetic task gives;
`--lengths lognormal` each its own length drawn as the recipe draws rollout.max_tokens
(recipes.rollouts.completion_budget: median `--median`, log-space std `--sigma`, capped at `--cap`;
the recipe's random models never stop sooner), the shape of reasoning RL; `--lengths fixed`: `--cap`.

Layouts (`--layouts`, recipes.batch.split_for_ranks): packed, each micro-batch's sequences back to back
in one row (the recipe's default, trainer.batching.packing), and padded, the same micro-batches (the same
sequences per forward: those that `--max-tokens-per-micro-batch` groups, or all of them) as rows
right-padded to the longest; with `--padded-rows N`, micro-batches of N sequences in batch order, padded,
as the trainer formed them before token budgets (trainer.batching.micro_batch_size). One arm's process takes its layouts in turns, step by step, their order
alternating from step to step and from round to round, so that a machine that slows slows both.

Per arm, round and layout: the median seconds of a step after warm-up (the device waited for), train
tokens/s (real tokens, prompt and completion, no pad, over that median), the pad share of the padded
rows; on GPUs the peak allocated memory and MFU (6 x parameters x tokens/s over the H200's bf16 peak,
recipes.metrics.H200_BF16_FLOPS). Per arm and round the paired ratio packed / padded tokens/s, and
per step; per round stock / canonical seconds per layout; the medians of both over the rounds. With
`--profile DIR`, one more step per layout under torch.profiler, its tables in
DIR/train_step_<arm>_<layout>.txt and its host and device totals in the JSON (a step whose device time
is well under its seconds is bound by the host).
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
LAYOUTS = ("packed", "padded")
LENGTHS = ("arithmetic", "fixed", "lognormal")


def samples(vocab: int, prompts: int, group: int, lengths: str = "arithmetic", median: int | None = None,
            sigma: float = 0.0, cap: int = 16, seed: int = 0) -> list:
    """The bench's rollouts: random prompt and completion tokens, advantages in [-1, 1]. Completion
    lengths: arithmetic, 4-16 tokens; fixed or lognormal, recipes.rollouts.completion_budget of
    (seed, step 1, prompt p, sample j), as the recipe draws max_tokens."""
    from recipes.batch import Sample
    from recipes.rollouts import completion_budget
    rng = random.Random(seed)
    top = min(vocab, 1000)
    out = []
    for p in range(prompts):
        prompt = [rng.randrange(1, top) for _ in range(rng.randrange(7, 12))]
        for j in range(group):
            n = (rng.randrange(4, 17) if lengths == "arithmetic"
                 else completion_budget(seed, 1, p, j, lengths, cap, median, sigma))
            out.append(Sample(prompt, [rng.randrange(1, top) for _ in range(n)], [-1.0] * n, rng.uniform(-1.0, 1.0)))
    return out


def batch(vocab: int, prompts: int, group: int, seed: int = 0, layout: str = "padded",
          max_tokens_per_micro_batch: int = 0, **lengths):
    """split_for_ranks of `samples` for one rank and one mini-batch: (plans, tokens per mini-batch)."""
    from recipes.batch import split_for_ranks
    return split_for_ranks(samples(vocab, prompts, group, seed=seed, **lengths), world=1, mini_batches=1,
                           max_tokens_per_micro_batch=max_tokens_per_micro_batch, packed=layout == "packed")


def layout_plans(batch_samples: list, layouts: list[str], max_tokens_per_micro_batch: int,
                 padded_rows: int = 0) -> dict:
    """{layout: split_for_ranks(...) of one rank and one mini-batch}. The same samples in every layout and,
    unless padded_rows > 0, the same micro-batches: only their layout differs. padded_rows > 0: the padded
    layout's micro-batches are that many sequences in batch order (trainer.batching.micro_batch_size)."""
    from recipes.batch import split_for_ranks
    plans = {}
    for layout in layouts:
        rows = padded_rows if layout == "padded" else 0
        plans[layout] = split_for_ranks(batch_samples, world=1, mini_batches=1, micro_batch_size=rows,
                                        max_tokens_per_micro_batch=0 if rows else max_tokens_per_micro_batch,
                                        packed=layout == "packed")
    return plans


def layout_shape(micro_batches: list[dict]) -> dict:
    """Real tokens (no pad), tokens in the tensors (pad included) and micro-batches of one rank's plan."""
    from recipes.batch import real_tokens
    real = sum(real_tokens(mb) for mb in micro_batches)
    held = sum(mb["input_ids"].numel() for mb in micro_batches)
    return {"tokens": real, "tensor_tokens": held, "pad_fraction": 1 - real / held,
            "micro_batches": len(micro_batches)}


def completion_lengths(batch_samples: list) -> dict:
    lengths = [len(s.token_ids) for s in batch_samples]
    return {"median": statistics.median(lengths), "mean": statistics.fmean(lengths), "min": min(lengths),
            "max": max(lengths), "count": len(lengths)}


def mfu(num_params: int, tokens_per_s: float) -> float:
    """Model FLOPs utilisation of one H200: 6 x parameters FLOPs per trained token (forward and backward)."""
    from recipes.metrics import H200_BF16_FLOPS
    return 6 * num_params * tokens_per_s / H200_BF16_FLOPS


def run_arm(args) -> dict:
    """This process: one arm's trainer rank, its layouts' warm-up steps, timed steps in turns and
    optional profiles."""
    from bench.rollout import build_model
    from recipes.config import BatchingConfig, LossConfig, OptimizerConfig, TrainerConfig
    from recipes.trainer import TrainerRank
    device = torch.device(args.device)
    layouts = args.layouts.split(",")
    cfg = TrainerConfig(num_ranks=1, device=args.device, optimizer=OptimizerConfig(lr=1e-5),
                        loss=LossConfig(old_logprobs="rollout" if args.arm == "canonical" else "recompute"),
                        batching=BatchingConfig(max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                                                activation_checkpointing=args.activation_checkpointing,
                                                checkpoint_every=args.checkpoint_every))
    model = build_model(args.model, args.device)
    num_params = sum(p.numel() for p in model.parameters())
    batch_samples = samples(model.config.vocab_size, args.prompts, args.group, args.lengths, args.median, args.sigma,
                            args.cap)
    plans = layout_plans(batch_samples, layouts, args.max_tokens_per_micro_batch, args.padded_rows)
    rank = TrainerRank(0, 1, cfg, temperature=1.0, numerics=args.arm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank.setup("127.0.0.1", port, model)
    cuda = device.type == "cuda"
    allocs = {layout: [] for layout in layouts}
    clocks = {layout: [] for layout in layouts}

    def step(layout: str) -> tuple[float, int]:
        """Seconds of one train step of `layout`, and its peak allocated device memory (0 on CPU); the
        step's cudaMalloc calls are kept in `allocs`, its GPU's median SM clock in `clocks`."""
        minibatches, tokens = plans[layout]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        result = rank.train_step(minibatches[0], tokens)
        allocs[layout].append(result["device_allocs"])
        clocks[layout].append(result["gpu_clocks"].get("sm_clock_mhz"))
        if cuda:
            if args.empty_cache:
                torch.cuda.empty_cache()
            torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated(device) if cuda else 0

    for _ in range(args.warmup):
        for layout in layouts:
            step(layout)
    seconds, peaks = {layout: [] for layout in layouts}, {layout: 0 for layout in layouts}
    for k in range(args.steps):
        for layout in (layouts if k % 2 == 0 else layouts[::-1]):
            s, peak = step(layout)
            seconds[layout].append(s)
            peaks[layout] = max(peaks[layout], peak)
    out = {"arm": args.arm, "layouts": layouts, "num_params": num_params,
           "completion_lengths": completion_lengths(batch_samples)}
    for layout in layouts:
        figures = {**layout_shape(plans[layout][0][0][0]), "seconds": seconds[layout],
                   "median_s": statistics.median(seconds[layout])}
        figures["tokens_per_s"] = figures["tokens"] / figures["median_s"]
        if cuda:
            figures["device_allocs"] = allocs[layout][-len(seconds[layout]):]
            figures["sm_clock_mhz"] = clocks[layout][-len(seconds[layout]):]  # None where nvidia-smi is not
            figures["peak_memory_gib"] = peaks[layout] / 2 ** 30
            figures["mfu"] = mfu(num_params, figures["tokens_per_s"])
        out[layout] = figures
    if "packed" in out and "padded" in out:
        out["packed_over_padded_tokens_per_s"] = out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
        # step k of one layout against step k of the other (the same tokens: the inverse ratio of seconds)
        out["packed_over_padded_per_step"] = [d / p for p, d in zip(seconds["packed"], seconds["padded"])]
    if args.profile:
        for layout in layouts:
            out[layout].update(profile_step(lambda: step(layout)[0], device, args.profile,
                                            f"train_step_{args.arm}_{layout}.txt"))
    rank.close()
    return out


def profile_step(step, device: torch.device, directory: str, name: str) -> dict:
    """One step under torch.profiler: its tables in directory/name, its host and device totals."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        out = {"profiled_step_s": step()}
    events = prof.key_averages()
    out["host_self_s"] = sum(e.self_cpu_time_total for e in events) / 1e6
    out["device_self_s"] = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e6
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with open(os.path.join(directory, name), "w") as f:
        f.write(events.table(sort_by=sort, row_limit=40, max_name_column_width=70))
        f.write("\n\nBy host time\n")
        f.write(events.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))
    return out


def with_medians(result: dict, arms: list[str], layouts: list[str]) -> dict:
    """Per round stock / canonical seconds per layout; the medians over the rounds of it and of each arm's
    packed / padded tokens/s (per round, and every round's steps pooled)."""
    rounds = result["rounds"]
    if "canonical" in arms and "stock" in arms:
        for row in rounds:
            row["stock_over_canonical"] = {
                layout: row["stock"][layout]["median_s"] / row["canonical"][layout]["median_s"] for layout in layouts}
        result["stock_over_canonical_median"] = {
            layout: statistics.median(r["stock_over_canonical"][layout] for r in rounds) for layout in layouts}
    if "packed" in layouts and "padded" in layouts:
        result["packed_over_padded_tokens_per_s_median"] = {
            arm: statistics.median(r[arm]["packed_over_padded_tokens_per_s"] for r in rounds) for arm in arms}
        result["packed_over_padded_per_step_median"] = {
            arm: statistics.median(x for r in rounds for x in r[arm]["packed_over_padded_per_step"]) for arm in arms}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen1.5b", help="a bench.rollout shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--lengths", choices=LENGTHS, default="arithmetic",
                    help="completion lengths: arithmetic (4-16), fixed (--cap) or lognormal (--median, --sigma, --cap)")
    ap.add_argument("--median", type=int, default=1024, help="lognormal: the median completion length")
    ap.add_argument("--sigma", type=float, default=0.7, help="lognormal: the std of the length's logarithm")
    ap.add_argument("--cap", type=int, default=4096, help="fixed and lognormal: the longest completion")
    ap.add_argument("--max-tokens-per-micro-batch", type=int, default=0,
                    help="token budget of one forward (trainer.batching.max_tokens_per_micro_batch); 0: one "
                         "micro-batch")
    ap.add_argument("--padded-rows", type=int, default=0,
                    help="padded layout: micro-batches of this many sequences in batch order "
                         "(trainer.batching.micro_batch_size, the trainer before token budgets); 0: the packed "
                         "layout's micro-batches, padded")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute each decoder layer's activations in the backward "
                         "(trainer.batching.activation_checkpointing)")
    ap.add_argument("--checkpoint-every", type=int, default=1,
                    help="with --activation-checkpointing, checkpoint layers 0, N, 2N, ... only "
                         "(trainer.batching.checkpoint_every)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help=f"micro-batch layouts, taken in turns; of {', '.join(LAYOUTS)}")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"the arms, in this order; of {', '.join(ARMS)}")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per layout")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm, layout and round")
    ap.add_argument("--rounds", type=int, default=1, help="the arms in turn, this many times")
    ap.add_argument("--empty-cache", action="store_true",
                    help="give the allocator's cache back after each step, so that the next one allocates from the "
                         "device again, as a colocated rank's does (it empties the cache after its last backward, "
                         "before its engine wakes: recipes.step_memory)")
    ap.add_argument("--profile", default=None, help="a directory: one profiled step per arm and layout (last round)")
    ap.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)  # a child process's arm
    args = ap.parse_args()
    arms, layouts = args.arms.split(","), args.layouts.split(",")
    for name, given, known in (("--arms", arms, ARMS), ("--layouts", layouts, LAYOUTS)):
        if set(given) - set(known) or len(set(given)) != len(given):
            ap.error(f"{name}: {','.join(given)}: each of {', '.join(known)} at most once")
    if args.checkpoint_every < 1:
        ap.error(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    if args.lengths == "lognormal" and not 1 <= args.median <= args.cap:
        ap.error(f"--median must be in 1 .. --cap ({args.cap}), got {args.median}")
    if args.arm is not None:
        print(json.dumps(run_arm(args)))
        return
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    passed = ["--model", args.model, "--device", args.device, "--prompts", str(args.prompts), "--group",
              str(args.group), "--lengths", args.lengths, "--median", str(args.median), "--sigma", str(args.sigma),
              "--cap", str(args.cap), "--max-tokens-per-micro-batch", str(args.max_tokens_per_micro_batch),
              "--warmup", str(args.warmup), "--steps", str(args.steps), "--padded-rows", str(args.padded_rows),
              "--checkpoint-every", str(args.checkpoint_every)]
    passed += ["--activation-checkpointing"] * args.activation_checkpointing + ["--empty-cache"] * args.empty_cache
    rounds = []
    for r in range(args.rounds):
        order, layout_order = (arms, layouts) if r % 2 == 0 else (arms[::-1], layouts[::-1])
        row = {"order": order, "layouts": layout_order}
        for arm in order:
            cmd = [sys.executable, "-m", "bench.grpo_train_step", "--arm", arm, "--layouts", ",".join(layout_order),
                   *passed]
            if args.profile and r == args.rounds - 1:
                cmd += ["--profile", args.profile]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"arm {arm} failed:\n{proc.stderr[-3000:]}")
            row[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
            figures = ", ".join(f"{layout} {row[arm][layout]['median_s']:.3f} s a step, "
                                f"{row[arm][layout]['tokens_per_s']:.0f} tokens/s" for layout in layout_order)
            print(f"[bench] round {r} {arm}: {figures}", file=sys.stderr, flush=True)
        rounds.append(row)
    first = rounds[0][arms[0]]
    result = {"model": args.model, "device": args.device, "prompts": args.prompts, "group": args.group,
              "lengths": args.lengths, **({"median": args.median, "sigma": args.sigma} if args.lengths == "lognormal"
                                          else {}),
              **({"cap": args.cap} if args.lengths != "arithmetic" else {}),
              "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch,
              "activation_checkpointing": args.activation_checkpointing, "empty_cache": args.empty_cache,
              **({"checkpoint_every": args.checkpoint_every} if args.activation_checkpointing else {}), "arms": arms, "layouts": layouts,
              "num_params": first["num_params"], "completion_lengths": first["completion_lengths"],
              "rounds": rounds}
    print(json.dumps(with_medians(result, arms, layouts), indent=1))


if __name__ == "__main__":
    main()
