"""The speed tables' decode attention steps against vLLM's FA3, in both split schedules over launch
tiles."""
from __future__ import annotations

import importlib
import json
import sys

import torch

import kernels.triton as kt
from bench.kernel_timing.attention import paged_decode_case
from bench.kernel_timing.timing import bench_ms

# Decode steps of the speed tables (Llama-3.1-8B: 32 query heads on 8 KV heads; Qwen2.5-1.5B: 12 on 2),
# (batch, context, q heads, KV heads, cache capacity = the workload's max_model_len)
DECODE_CASES = ((256, 560, 32, 8, 1040), (256, 1000, 32, 8, 1040), (128, 1000, 32, 8, 1040),
                (160, 1000, 32, 8, 1040), (200, 1000, 32, 8, 1040), (232, 1000, 32, 8, 1040), (64, 1000, 32, 8, 1040),
                (64, 1000, 12, 2, 1040), (256, 1000, 12, 2, 1040), (32, 4096, 32, 8, 9232),
                (32, 8192, 32, 8, 9232), (32, 8192, 12, 2, 9232),
                # around the schedule's switch at one (sequence, KV head) pair per SM (132 on H100)
                (17, 4096, 32, 8, 9232), (24, 4096, 32, 8, 9232), (72, 1000, 12, 2, 1040), (96, 1000, 12, 2, 1040),
                (160, 1000, 12, 2, 1040))


# (BLOCK_M, warps, stages) tried per decode case: 16-row tiles only (mma.sync, K and V in registers); 32- and
# 64-row wgmma tiles were slower at every case (bench/results/2026-11-27-h100-mlp-chunks).
DECODE_TILES = tuple((16, w, s) for w in (1, 2, 4, 8) for s in (1, 2, 3, 4))


def _fa3_paged_decode(q, kc, vc, ctx: int, table):
    """vLLM's own decode attention (FA3 through vllm_flash_attn, as its FlashAttention backend calls it)
    on the same paged cache, or None where this vLLM build has no FA3."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    bsz, _, hq, d = q.shape
    q2 = q.reshape(bsz, hq, d)
    cu_q = torch.arange(bsz + 1, device=q.device, dtype=torch.int32)
    used = torch.full((bsz,), ctx, device=q.device, dtype=torch.int32)
    out = torch.empty_like(q2)
    return lambda: flash_attn_varlen_func(q=q2, k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1,
                                          seqused_k=used, max_seqlen_k=ctx, softmax_scale=d ** -0.5,
                                          causal=True, block_table=table, fa_version=3)


def run_decode_attention(rep: int):
    """One decode step at the speed tables' shapes: the canonical attention as launched (the rule in
    kernels/triton/attention.py), and forced into each schedule (a program per split, then the merge
    kernel; or one program walking its splits: the same bits) over tiles (BLOCK_M, warps, stages),
    against vLLM's FA3 on the same 16-token-page cache."""
    A = importlib.import_module("kernels.triton.attention")
    out = []
    for bsz, ctx, hq, hkv, capacity in DECODE_CASES:
        q, kc, vc, pos, table = paged_decode_case(bsz, ctx, hq, hkv, max_len=capacity + (-capacity) % 16)
        call = lambda: kt.attention(q, kc, vc, pos, block_table=table)
        row = {"batch": bsz, "context": ctx, "q_heads": hq, "kv_heads": hkv, "capacity": capacity,
               "as_launched_ms": round(bench_ms(call, rep=rep), 4)}
        limit, A._OFFSETS_32_LIMIT = A._OFFSETS_32_LIMIT, 0  # the same launch with 64-bit key offsets
        try:
            row["as_launched_64bit_offsets_ms"] = round(bench_ms(call, rep=rep), 4)
        finally:
            A._OFFSETS_32_LIMIT = limit
        fa3 = _fa3_paged_decode(q, kc, vc, ctx, table)
        if fa3 is not None:
            row["fa3_ms"] = round(bench_ms(fa3, rep=rep), 4)
            row["as_launched_over_fa3"] = round(row["as_launched_ms"] / row["fa3_ms"], 3)
        kv_bytes = 2 * bsz * ctx * hkv * q.shape[-1] * 2
        row["as_launched_GBps"] = round(kv_bytes / row["as_launched_ms"] / 1e6, 1)
        for schedule, parallel in (("per_split", True), ("walk", False)):
            times = {}
            for tile in DECODE_TILES:
                A._FORCED_TILE, A._FORCED_PARALLEL_SPLITS = tile, parallel
                label = "/".join(map(str, tile))
                try:
                    times[label] = bench_ms(call, rep=rep)
                except Exception as exc:  # e.g. out of shared memory
                    print(f"# {schedule} {label}: {type(exc).__name__}", file=sys.stderr)
                finally:
                    A._FORCED_TILE = A._FORCED_PARALLEL_SPLITS = None
            best = min(times, key=times.get)
            row[schedule] = {"best_tile": best, "best_ms": round(times[best], 4),
                             "tiles_ms": {k: round(v, 4) for k, v in times.items()}}
        print("# decode", json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}),
              {s: (row[s]["best_tile"], row[s]["best_ms"]) for s in ("per_split", "walk")}, file=sys.stderr,
              flush=True)
        out.append(row)
        del q, kc, vc
    return out
