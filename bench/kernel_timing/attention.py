"""Canonical attention against SDPA: prefill and decode steps, and sweeps over launch tiles (which leave
the numbers alone) and split sizes (which change them)."""
from __future__ import annotations

import importlib
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels.triton as kt
from bench.kernel_timing.timing import bench_ms


def _sdpa(q, k, v, causal):
    """SDPA on [B, H, T, D], flash backend where it runs; returns (fn, backend used)."""
    groups = q.shape[1] // k.shape[1]
    tries = [(SDPBackend.FLASH_ATTENTION, True), (SDPBackend.FLASH_ATTENTION, False),
             (SDPBackend.EFFICIENT_ATTENTION, True)]
    for backend, gqa in tries:
        kk, vv = (k, v) if gqa else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))

        def fn(kk=kk, vv=vv, backend=backend, gqa=gqa):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa and groups > 1)
        try:
            fn()
            return fn, f"{backend.name}{'+gqa' if gqa else '+repeated_kv'}"
        except Exception:
            continue
    raise RuntimeError("no SDPA backend ran")


def run_attention(rep: int):
    dev, bf = "cuda", torch.bfloat16
    res = {}
    hq, hkv, d = 32, 8, 128
    # prefill: 4096 tokens, causal
    for bsz in (1, 4):
        t = 4096
        q = torch.randn(bsz, t, hq, d, device=dev, dtype=bf)
        k = torch.randn(bsz, t, hkv, d, device=dev, dtype=bf)
        v = torch.randn(bsz, t, hkv, d, device=dev, dtype=bf)
        pos = torch.arange(t, device=dev).repeat(bsz, 1)
        t_can = bench_ms(lambda: kt.attention(q, k, v, pos), rep=rep)
        fn, backend = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True)
        t_sdpa = bench_ms(fn, rep=rep)
        flops = 4.0 * bsz * hq * d * t * t / 2
        res[f"prefill_{bsz}x4096"] = {"canonical_ms": round(t_can, 4), "sdpa_ms": round(t_sdpa, 4),
                                      "sdpa_backend": backend, "canonical_over_sdpa": round(t_can / t_sdpa, 3),
                                      "canonical_tflops": round(flops / t_can / 1e9, 1),
                                      "sdpa_tflops": round(flops / t_sdpa / 1e9, 1)}
        del q, k, v
    # decode, one new token per sequence: (batch, keys in cache, query heads, KV heads) of Llama-8B and
    # of Qwen2.5-1.5B's long rollouts; canonical with the splits reduced in parallel (what a decode
    # step runs) and walked in one program (what prefill runs: same bits), against SDPA
    A = importlib.import_module("kernels.triton.attention")  # the module, not the package's function
    for bsz, ctx, hq, hkv in ((64, 4096, 32, 8), (32, 8192, 12, 2)):
        q = torch.randn(bsz, 1, hq, d, device=dev, dtype=bf)
        k = torch.randn(bsz, ctx, hkv, d, device=dev, dtype=bf)
        v = torch.randn(bsz, ctx, hkv, d, device=dev, dtype=bf)
        pos = torch.full((bsz, 1), ctx - 1, device=dev, dtype=torch.int64)
        t_can = bench_ms(lambda: kt.attention(q, k, v, pos), rep=rep)
        try:
            A._FORCED_PARALLEL_SPLITS = False
            t_walk = bench_ms(lambda: kt.attention(q, k, v, pos), rep=rep)
        finally:
            A._FORCED_PARALLEL_SPLITS = None
        fn, backend = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False)
        t_sdpa = bench_ms(fn, rep=rep)
        kv_bytes = 2 * k.numel() * k.element_size()
        entry = {"canonical_ms": round(t_can, 4), "canonical_walking_splits_ms": round(t_walk, 4),
                 "sdpa_ms": round(t_sdpa, 4), "sdpa_backend": backend,
                 "canonical_over_sdpa": round(t_can / t_sdpa, 3),
                 "canonical_GBps": round(kv_bytes / t_can / 1e6, 1), "sdpa_GBps": round(kv_bytes / t_sdpa / 1e6, 1)}
        # same cache paged (16-token pages, shuffled)
        bs = 16
        nb = ctx // bs
        perm = torch.randperm(bsz * nb, device=dev).reshape(bsz, nb).to(torch.int32)
        kc = torch.empty(bsz * nb, bs, hkv, d, device=dev, dtype=bf)
        vc = torch.empty_like(kc)
        kc[perm.reshape(-1).long()] = k.reshape(bsz * nb, bs, hkv, d)
        vc[perm.reshape(-1).long()] = v.reshape(bsz * nb, bs, hkv, d)
        t_paged = bench_ms(lambda: kt.attention(q, kc, vc, pos, block_table=perm), rep=rep)
        entry["canonical_paged16_ms"] = round(t_paged, 4)
        entry["canonical_paged16_over_sdpa"] = round(t_paged / t_sdpa, 3)
        res[f"decode_{bsz}x{ctx}_{hq}q{hkv}kv"] = entry
        del q, k, v, kc, vc
    return res


def paged_decode_case(bsz: int, ctx: int, hq: int, hkv: int, d: int = 128, page: int = 16, max_len: int = 4096):
    """One decode step over a shuffled 16-token-page cache whose block table spans max_len positions
    (as vLLM's does: the step is launched for the cache's capacity, not the sequence's length)."""
    dev, bf = "cuda", torch.bfloat16
    pages = max_len // page
    q = torch.randn(bsz, 1, hq, d, device=dev, dtype=bf)
    kc = torch.randn(bsz * pages + 1, page, hkv, d, device=dev, dtype=bf)
    vc = torch.randn_like(kc)
    table = (torch.randperm(bsz * pages, device=dev) + 1).reshape(bsz, pages).to(torch.int32)
    pos = torch.full((bsz, 1), ctx - 1, device=dev, dtype=torch.int64)
    return q, kc, vc, pos, table


def run_attention_sweep(rep: int):
    """Decode steps (Qwen2.5-1.5B: 12 query heads on 2 KV heads; Llama-3.1-8B: 32 on 8) at the
    contexts of the batch workload, over launch configurations (BLOCK_M, warps, stages), which leave
    the numbers alone; and over split sizes, which change them (the contract's is attention_split_kv:
    another size would be a new contract, for the trainer too)."""
    out = []
    for bsz, ctx, hq, hkv in ((64, 640, 12, 2), (64, 1000, 12, 2), (256, 1000, 12, 2), (64, 1000, 32, 8)):
        q, kc, vc, pos, table = paged_decode_case(bsz, ctx, hq, hkv)
        row = {"batch": bsz, "context": ctx, "q_heads": hq, "kv_heads": hkv}
        row["contract_ms"] = round(bench_ms(lambda: kt.attention(q, kc, vc, pos, block_table=table), rep=rep), 4)
        row.update(_time_tiles(lambda: kt.attention(q, kc, vc, pos, block_table=table),
                               [(16, w, st) for w in (1, 2, 4, 8) for st in (1, 2, 3, 4, 5)], rep))
        for split in (128, 256, 1024):
            row[f"split{split}_ms"] = round(bench_ms(
                lambda: kt.attention(q, kc, vc, pos, block_table=table, split_kv=split), rep=rep), 4)
        print("# attention sweep", json.dumps({k: v for k, v in row.items() if k != "tiles_ms"}), file=sys.stderr,
              flush=True)
        out.append(row)
    return out + _prefill_attention_sweep(rep)


def _time_tiles(run, tiles, rep: int) -> dict:
    """run() timed with each forced attention tile (BLOCK_M, warps, stages), which leave the numbers
    alone; a tile that does not launch (e.g. out of shared memory) is skipped."""
    A = importlib.import_module("kernels.triton.attention")
    times = {}
    for tile in tiles:
        A._FORCED_TILE = tile
        try:
            times["/".join(map(str, tile))] = bench_ms(run, rep=rep)
        except Exception as exc:
            print(f"# tile {tile}: {type(exc).__name__}", file=sys.stderr)
        finally:
            A._FORCED_TILE = None
    best = min(times, key=times.get)
    return dict(best_tile=best, best_tile_ms=round(times[best], 4), tiles_ms={k: round(v, 4) for k, v in times.items()})


def _prefill_attention_sweep(rep: int):
    """Prefill steps as the 256 x 512 tables run them (32 prompts of 512 tokens, 16,384 rows) over the
    tile (BLOCK_M, warps, stages), against SDPA's flash backend on the same tensors."""
    dev, bf, d, out = "cuda", torch.bfloat16, 128, []
    for bsz, t, hq, hkv in ((32, 512, 32, 8), (32, 512, 12, 2)):
        q = torch.randn(bsz, t, hq, d, device=dev, dtype=bf)
        k = torch.randn(bsz, t, hkv, d, device=dev, dtype=bf)
        v = torch.randn(bsz, t, hkv, d, device=dev, dtype=bf)
        pos = torch.arange(t, device=dev).repeat(bsz, 1)
        fn, backend = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True)
        row = {"prefill": f"{bsz}x{t}", "q_heads": hq, "kv_heads": hkv, "sdpa_backend": backend,
               "sdpa_ms": round(bench_ms(fn, rep=rep), 4),
               "contract_ms": round(bench_ms(lambda: kt.attention(q, k, v, pos), rep=rep), 4)}
        row.update(_time_tiles(lambda: kt.attention(q, k, v, pos),
                               [(bm, w, st) for bm in (64, 128, 256) for w in (4, 8) for st in (1, 2, 3)], rep))
        print("# prefill attention sweep", json.dumps({k: v for k, v in row.items() if k != "tiles_ms"}),
              file=sys.stderr, flush=True)
        out.append(row)
        del q, k, v
    return out

