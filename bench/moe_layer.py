"""Time one Qwen3-MoE sparse layer: the canonical one against stock implementations; prints JSON.

    python bench/moe_layer.py [--tokens 256,512,1024,2048,4096] [--reps 20] [--out FILE] [--tiny] [--sweep]

Qwen3-30B-A3B's layer (hidden 2048, moe_intermediate_size 768, 128 experts, top-8, norm_topk_prob),
random bf16 weights. Per tokens-per-step, the time of one layer forward (routing, experts, combine):
- ours: kernels.moe.moe_forward with CANONICAL_OPS (on CUDA the grouped Triton kernels);
- loop: the same with the experts as a loop (kernels.moe.experts_loop), for reference;
- hf_eager: transformers' Qwen3MoeSparseMoeBlock forward with its loop over experts;
- hf_grouped_mm: the same block with transformers' torch grouped_mm experts (bf16 GEMMs, its default
  where it runs), where this torch and device have grouped_mm.
x_fastest_stock = the fastest stock time / ours, with CUDA events around each call (host overhead
included), median of --reps after warm-up. On CUDA, ours and hf_grouped_mm are also timed as replayed
CUDA graphs (GPU time alone: *_graph_ms, x_hf_grouped_mm_graph). Without CUDA (or with --tiny) a tiny
layer runs on the CPU (a smoke test, timed with the wall clock). --sweep (CUDA) times a grid of launch
configurations of the two grouped products per token count instead (the table in kernels/triton/moe.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import transformers
from tqdm import tqdm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import emit  # noqa: E402
from kernels.forward import CANONICAL_OPS  # noqa: E402
from kernels.moe import group_by_expert, moe_forward, moe_spec  # noqa: E402

A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
TOKENS = [256, 512, 1024, 2048, 4096]
TINY_TOKENS = [16, 64]


def make_block(shape: dict, device: torch.device, seed: int = 0):
    """transformers' sparse block with random bf16 weights (std 0.02: router logits of std ~1)."""
    cfg = transformers.Qwen3MoeConfig(**shape)
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block.to(device=device, dtype=torch.bfloat16).eval(), cfg


def ours(block, spec, grouped=None):
    bf16 = lambda t: t.to(torch.bfloat16)  # noqa: E731
    return lambda x: moe_forward(block, x, spec, CANONICAL_OPS, bf16, grouped=grouped)


def hf(block, implementation: str):
    """transformers' block forward with one of its experts implementations: "eager" is its loop over
    experts, "grouped_mm" its torch grouped_mm path (the default of models it builds where it runs)."""
    def fwd(x):
        block.experts.config._experts_implementation = implementation
        return block(x)
    return fwd


def time_ms(fn, x, reps: int, warmup: int = 3) -> float:
    """Median time of one call (ms): CUDA events on CUDA, the wall clock on the CPU."""
    for _ in range(warmup):
        fn(x)
    cuda = x.is_cuda
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(fn, x, reps: int) -> float | None:
    """Median replay time (ms) of fn captured in a CUDA graph; None where it cannot be captured."""
    static_x = x.clone()
    try:
        fn(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(static_x)
    except Exception as exc:  # a host sync or an allocation that capture refuses
        print(f"# capture failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        return None
    return time_ms(lambda _: graph.replay(), static_x, reps)


def runs(fn, x) -> bool:
    try:
        fn(x)
        return True
    except Exception as exc:  # e.g. no grouped_mm kernel for this device or torch
        print(f"# skipped: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        return False


def run(shape: dict, tokens: list[int], device: torch.device, reps: int) -> dict:
    block, cfg = make_block(shape, device)
    spec = moe_spec(cfg)
    systems = {"ours": ours(block, spec), "loop": ours(block, spec, grouped=False), "hf_eager": hf(block, "eager")}
    probe = torch.randn(1, 8, shape["hidden_size"], device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        if runs(hf(block, "grouped_mm"), probe):
            systems["hf_grouped_mm"] = hf(block, "grouped_mm")
    stock = [name for name in ("hf_eager", "hf_grouped_mm") if name in systems]
    rows = []
    bar = tqdm(total=len(tokens) * len(systems), desc="moe layer", file=sys.stderr)
    with torch.no_grad():
        for t in tokens:
            x = torch.randn(1, t, shape["hidden_size"], device=device, dtype=torch.bfloat16,
                            generator=torch.Generator(device=device).manual_seed(t))
            row = {"tokens": t}
            for name, fn in systems.items():
                n = max(3, reps // 4) if name in ("loop", "hf_eager") else reps  # the loops are slow
                row[f"{name}_ms"] = round(time_ms(fn, x, n), 4)
                bar.update(1)
            best = min(stock, key=lambda s: row[f"{s}_ms"])
            row["fastest_stock"] = best
            row["x_fastest_stock"] = round(row[f"{best}_ms"] / row["ours_ms"], 3)
            if device.type == "cuda":  # GPU time alone: the layers that a CUDA graph can hold
                for name in ("ours", "hf_grouped_mm"):
                    if name in systems:
                        g = graph_ms(systems[name], x, reps)
                        row[f"{name}_graph_ms"] = None if g is None else round(g, 4)
                if row.get("ours_graph_ms") and row.get("hf_grouped_mm_graph_ms"):
                    row["x_hf_grouped_mm_graph"] = round(row["hf_grouped_mm_graph_ms"] / row["ours_graph_ms"], 3)
            row["x_loop"] = round(row["loop_ms"] / row["ours_ms"], 3)
            rows.append(row)
            print("#", row, file=sys.stderr, flush=True)
    bar.close()
    return {"rows": rows, "stock": stock}


def sweep(shape: dict, tokens: list[int], reps: int) -> list[dict]:
    """Best launch configuration of the grouped gate_up (+ silu) and down products per token count."""
    from kernels.triton import moe as ktm  # triton is optional
    block, cfg = make_block(shape, torch.device("cuda"))
    spec = moe_spec(cfg)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    out = []
    for t in tokens:
        avg = t * spec.top_k / spec.num_experts
        near = sorted((16, 32, 64, 128), key=lambda bm: abs(bm - avg))[:2]  # row tiles around the load
        grid = [ktm.GroupedConfig(bm, bn, w, st) for bm in near for bn in (64, 128, 256) for w in (4, 8)
                for st in (3, 4) if not (bm == 16 and w == 8)]
        for silu in (True, False):  # the table's own entries, timed too
            if ktm.pick_config(t * spec.top_k, spec.num_experts, silu) not in grid:
                grid.append(ktm.pick_config(t * spec.top_k, spec.num_experts, silu))
        x = torch.randn(t, shape["hidden_size"], device="cuda", dtype=torch.bfloat16)
        ids = torch.sort(torch.rand(t, spec.num_experts, device="cuda").topk(spec.top_k, -1).indices, -1).values
        groups = group_by_expert(ids, spec.num_experts)
        h = ktm.grouped_matmul(x, gate_up, groups.offsets, src=groups.token, silu=True)
        products = {"gate_up_silu": lambda c: ktm.grouped_matmul(x, gate_up, groups.offsets, src=groups.token,
                                                                 silu=True, config=c),
                    "down": lambda c: ktm.grouped_matmul(h, down, groups.offsets, dst=groups.slot, config=c)}
        for name, fn in products.items():
            default = ktm.pick_config(t * spec.top_k, spec.num_experts, name == "gate_up_silu")
            times = {}
            for c in tqdm(grid, desc=f"sweep {name} T={t}", file=sys.stderr):
                try:
                    times[c] = time_ms(lambda _: fn(c), x, reps)
                except Exception as exc:  # a config that does not fit (shared memory, registers)
                    print(f"# {c}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
            best = min(times, key=times.get)
            row = {"tokens": t, "product": name, "best": vars(best), "best_ms": round(times[best], 4),
                   "default": vars(default), "default_ms": round(times.get(default, float("nan")), 4),
                   "top5": [[vars(c), round(times[c], 4)] for c in sorted(times, key=times.get)[:5]]}
            print("# sweep", row, file=sys.stderr, flush=True)
            out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", help="tokens per step, e.g. 256,4096")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per point (the loops take a quarter)")
    ap.add_argument("--tiny", action="store_true", help="a tiny layer (the default without CUDA)")
    ap.add_argument("--sweep", action="store_true", help="time launch configurations of the grouped products")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    tiny = args.tiny or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    shape = TINY if tiny else A3B
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (TINY_TOKENS if tiny else TOKENS)
    t0 = time.time()
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "shape": "tiny" if tiny else "Qwen3-30B-A3B", **shape}
    if cuda:
        import triton
        doc["triton"] = triton.__version__
    doc["grouped_experts"] = cuda  # ours: the grouped kernels on CUDA, the loop on the CPU
    if args.sweep and cuda:
        doc["sweep"] = sweep(shape, tokens, args.reps)
    else:
        doc.update(run(shape, tokens, device, args.reps))
    doc["seconds"] = round(time.time() - t0, 1)
    emit(doc, args.out)


if __name__ == "__main__":
    main()
