"""Where one decode step's time goes (CUDA): prints JSON of per-part milliseconds.

    python -m bench.decode_step --model qwen1.5b --batch 64 --context 768

Parts: the fast path's graphed forward, the verifier's graphed one-token forward, the verifier's
graphed verify window (group x (window + 1) tokens), sampling, log-probs, and one whole native
fast-path step and a whole proposal window per step (host work included) for comparison with their sum,
and a window of canonical steps (how `invariant` decodes) per step.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.rollout import SHAPES, build_model
from kernels.forward import CANONICAL_OPS
from rollout_service import Engine, SamplingParams
from rollout_service.engine.fast_path.native_ops import FAST_OPS
from rollout_service.engine.fast_path.base import DraftRequest
from rollout_service.engine.sampler import sample_rows, token_logprobs_at
from rollout_service.engine.runner import Chunk, ModelRunner


def gpu_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / reps, 3)


def wall_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / reps * 1e3, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen1.5b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, help="block-table width (default: context + window + 32)")
    ap.add_argument("--profile", help="also write per-kernel CUDA times (eager forwards) to this text file")
    args = ap.parse_args()
    model = build_model(args.model, "cuda")
    bsz, ctx, w = args.batch, args.context, args.window
    engine = Engine(model, device="cuda", window=w, group=args.group, copy_model=False, max_num_seqs=bsz,
                    kv_cache_tokens=bsz * (ctx + w + 32), max_model_len=args.max_model_len or ctx + w + 32)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    blocks = []
    for _ in range(bsz):
        ids: list[int] = []
        engine.cache.ensure(ids, ctx + w + 1)
        blocks.append(ids)
    params = [SamplingParams(max_tokens=w, temperature=1.0, seed=i) for i in range(bsz)]
    tokens = [[rng.randrange(vocab) for _ in range(ctx)] for _ in range(bsz)]
    decode = [Chunk([t[-1]], ctx - 1, b, 1) for t, b in zip(tokens, blocks)]
    g = min(args.group, bsz)
    window = [Chunk(t[-w - 1:], ctx - w - 1, b, w + 1) for t, b in zip(tokens[:g], blocks[:g])]
    fast, verifier = engine.fast_path.runner, engine.canonical_runner
    logits = torch.cat(fast.forward(decode))
    positions = [ctx] * bsz
    out = {"model": args.model, "batch": bsz, "context": ctx, "device": torch.cuda.get_device_name()}
    out["fast_forward_ms"] = wall_ms(lambda: fast.forward(decode))
    out["canonical_forward_ms"] = wall_ms(lambda: verifier.forward(decode))
    out["verify_window_ms"] = wall_ms(lambda: verifier.forward(window))
    out["verify_window_tokens"] = g * (w + 1)
    out["sample_gpu_ms"] = gpu_ms(lambda: sample_rows(logits, params, positions))
    out["sample_wall_ms"] = wall_ms(lambda: sample_rows(logits, params, positions))
    toks = sample_rows(logits, params, positions)
    out["logprobs_wall_ms"] = wall_ms(lambda: token_logprobs_at(logits, params, toks,
                                                                lambda x: torch.log_softmax(x, dim=-1)))
    drafts = [DraftRequest(i, tokens[i], params[i], 1, blocks[i], ctx // 2) for i in range(bsz)]
    out["native_step_wall_ms"] = wall_ms(lambda: engine.fast_path.propose(drafts))
    drafts = [DraftRequest(i, tokens[i], params[i], w, blocks[i], ctx // 2) for i in range(bsz)]
    out["native_window_wall_ms_per_step"] = round(wall_ms(lambda: engine.fast_path.propose(drafts), reps=5) / w, 3)
    out["canonical_window_wall_ms_per_step"] = round(wall_ms(lambda: engine.canonical_decoder.propose(drafts),
                                                             reps=5) / w, 3)
    graph, _, _ = fast._graphs[fast.shape_for(decode)]
    out["fast_graph_replay_gpu_ms"] = gpu_ms(graph.replay)
    graph, _, _ = verifier._graphs[verifier.shape_for(decode)]
    out["canonical_graph_replay_gpu_ms"] = gpu_ms(graph.replay)
    print(json.dumps(out, indent=1))
    if args.profile:
        write_profile(args.profile, engine, decode, window)


def write_profile(path: str, engine: Engine, decode, window) -> None:
    """Kernel tables of the eager forwards (graph replays hide their kernels from the profiler)."""
    parts = {"verify window (canonical)": (CANONICAL_OPS, window), "decode step (canonical)": (CANONICAL_OPS, decode),
             "decode step (fast)": (FAST_OPS, decode)}
    with open(path, "w") as f:
        for name, (ops, chunks) in parts.items():
            runner = ModelRunner(engine.model, engine.cache, ops, engine.device)
            runner.forward(chunks)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    runner.forward(chunks)
                torch.cuda.synchronize()
            f.write(f"== {name}, 3 forwards ==\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
            f.write("\n\n")


if __name__ == "__main__":
    main()
