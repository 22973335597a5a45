"""The colocated engine cycle, one process, no Ray: rollout, sleep, a trainer's use of the GPU, wake,
a bucketed weight push; the canonical VLLMEngine against the stock one, at sleep level 1 and 2; JSON.

    python -m bench.colocated_cycle --model qwen1.5b --arms canonical,stock

This is the rollout worker's side of a colocated GRPO step (recipes/configs/gpu_colocated.yaml) without
the pool and the trainer ranks around it, so each part is timed alone: 32 prompts x 8 samples x 16
tokens per rollout, then the engine sleeps, the GPU is used as a trainer rank uses it (30 GB written,
matmuls), the engine wakes and takes every weight as a push does (load_named_weights in buckets, then
finish_weight_load). Levels take turns (1, 2, 1, 2), three cycles each; medians per arm and level.
The first sleep of an engine allocates its pinned host buffers and is reported apart. With
--early-weights-wake the engine maps its weights again right after each sleep (wake_weights, which
the rollout worker runs behind the sleep while the trainer steps), timed as its own part, and the
wake maps the KV cache alone; without it that part does nothing. --kv-cache-gib 1,8 builds each arm
once per KV cache size (vLLM's kv_cache_memory_bytes) instead of at 0.3 of the GPU, in turn in one
process, to show how the wake's time follows the memory it maps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from bench.weight_sync import SHAPES, build

PARTS = ("rollout", "sleep", "wake_weights", "trainer", "wake", "push")


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def trainer_like(nbytes: int) -> None:
    """What a colocated trainer rank does to the memory the engine freed: writes it, multiplies."""
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    big = torch.full((nbytes,), 1, dtype=torch.uint8, device="cuda")
    for _ in range(20):
        x = (x @ x).clamp_(-1, 1)
    del big, x


def run_arm(arm: str, path: str, weights, prompts, cycles: int, trainer_bytes: int, early: bool = False,
            kv_cache_bytes: int | None = None) -> dict:
    from rollout_service import SamplingParams
    from rollout_service.vllm.engine import VLLMEngine

    determinism = "off" if arm == "stock" else "verified"

    def params(step):
        return [SamplingParams(max_tokens=16, seed=step * 1000 + i, temperature=1.0, determinism=determinism)
                for i in range(len(prompts))]

    def push():
        for i in range(0, len(weights), 40):
            engine.load_named_weights(weights[i:i + 40])
        engine.finish_weight_load()

    t0 = time.perf_counter()
    engine = VLLMEngine(path, device="cuda", max_model_len=128, max_num_seqs=256, sleep_mode=True,
                        gpu_memory_utilization=0.3, stock_only=arm == "stock",
                        early_weights_wake=early,
                        vllm_options={"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes else None)
    result = {"build_s": time.perf_counter() - t0,
              "first_rollout_s": timed(lambda: engine.generate(prompts, params(0)))}
    times = {level: {part: [] for part in PARTS} for level in (1, 2)}
    step = 0
    try:
        for level in (1, 2, 1, 2):
            engine.sleep_level = level
            for _ in range(cycles):
                step += 1
                row = times[level]
                row["rollout"].append(timed(lambda: engine.generate(prompts, params(step))))
                sleep_s = timed(engine.sleep)
                if step == 1:
                    result["first_sleep_s"] = sleep_s  # pinned host buffers allocated (level 1)
                else:
                    row["sleep"].append(sleep_s)
                row["wake_weights"].append(timed(engine.wake_weights))
                row["trainer"].append(timed(lambda: trainer_like(trainer_bytes)))
                row["wake"].append(timed(engine.wake))
                row["push"].append(timed(push))
    finally:
        engine.close()
    for level, row in times.items():
        result[f"level{level}"] = {f"{part}_s": statistics.median(v) for part, v in row.items()}
    return result


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON alone
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="qwen1.5b")
    ap.add_argument("--arms", default="canonical,stock")
    ap.add_argument("--cycles", type=int, default=3, help="per level and turn")
    ap.add_argument("--trainer-gb", type=float, default=30.0)
    ap.add_argument("--early-weights-wake", action="store_true", help="VLLMEngine early_weights_wake")
    ap.add_argument("--kv-cache-gib", default="", help="GiB, comma-separated; 0: 0.3 of the GPU")
    args = ap.parse_args()
    model = build(args.model, seed=0, device="cuda")
    path = tempfile.mkdtemp(prefix="zerokl-bench-cycle-")
    model.cpu().save_pretrained(path)
    weights = [(name, t.cuda()) for name, t in model.state_dict().items()]
    del model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (int(torch.randint(10, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(32)]
    prompts = [p for p in prompts for _ in range(8)]
    out = {"model": args.model, "cycles": args.cycles, "early_weights_wake": args.early_weights_wake}
    sizes = [float(g) for g in args.kv_cache_gib.split(",")] if args.kv_cache_gib else [None]
    for gib in sizes:
        for arm in args.arms.split(","):
            key = arm if gib is None else f"{arm}@kv{gib:g}GiB" if gib else f"{arm}@kv0.3"
            out[key] = run_arm(arm, path, weights, prompts, args.cycles, int(args.trainer_gb * 1e9),
                               args.early_weights_wake, int(gib * (1 << 30)) if gib else None)
            print(f"[bench] {key}: {json.dumps(out[key])}", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
