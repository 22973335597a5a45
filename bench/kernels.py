"""Benchmark the Triton canonical kernels against cuBLAS / SDPA / torch on one GPU; prints JSON.

    python bench/kernels.py [--out FILE] [--quick] [--sweep]

matmul: Llama-3.1-8B shapes x M in {1 .. 8192}; canonical TFLOP/s (launch table), cuBLAS
(torch.matmul) TFLOP/s and their ratio. o and down are row-parallel in the canonical forward, so they
are measured with the 8-segment tree too ("segments": 8). --sweep also times a grid of launch
configurations per (shape, M) and reports the best (used to write the launch table in
kernels/triton/matmul.py). attention: prefill 4k and decode batch 64 x 4k context vs
scaled_dot_product_attention; with --sweep, decode steps over tiles and split sizes, and prefill steps
(32 prompts of 512 tokens) over tiles. decode (--only decode): the speed tables' decode steps against vLLM's
FA3, in both split schedules over launch tiles. rms_norm and log_softmax vs torch.
"""
from __future__ import annotations

import argparse
import importlib
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kernels.triton as kt  # noqa: E402
from kernels.triton import MMConfig  # noqa: E402
from bench import emit  # noqa: E402

# (name, K, N, segments): Llama-3.1-8B projections; QWEN_SHAPES: Qwen2.5-1.5B (`--model qwen1.5b`)
SHAPES = [("qkv", 4096, 6144, 1), ("o", 4096, 4096, 1), ("o", 4096, 4096, 8), ("gate_up", 4096, 28672, 1),
          ("down", 14336, 4096, 1), ("down", 14336, 4096, 8), ("lm_head", 4096, 128256, 1)]
QWEN_SHAPES = [("qkv", 1536, 2048, 1), ("o", 1536, 1536, 8), ("gate_up", 1536, 17920, 1), ("down", 8960, 1536, 8),
               ("lm_head", 1536, 151936, 1)]
MS = [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# Shorter trees (a smaller largest-TP degree) for comparison, at a few M.
TREE_VARIANTS = [("o", 4096, 4096, 2), ("o", 4096, 4096, 4), ("down", 14336, 4096, 2), ("down", 14336, 4096, 4)]
TREE_VARIANT_MS = [64, 512, 2048, 8192]


_FLUSH = []


def bench_ms(fn, rep=100, warmup=None):
    """GPU time per call in ms with a cold L2 and no launch overhead: a CUDA graph of n x (flush L2,
    fn) minus one of n x (flush L2), median of several replays. Falls back to triton's do_bench."""
    del warmup
    if not _FLUSH:
        _FLUSH.append(torch.empty(64 * 2 ** 20 // 4, dtype=torch.int32, device="cuda"))
    buf = _FLUSH[0]
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = max(3, min(50, int(rep * 1e-3 / 4 / max(time.perf_counter() - t0, 1e-6))))
    try:
        graphs = []
        for with_fn in (True, False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(n):
                    buf.zero_()
                    if with_fn:
                        fn()
            graphs.append(g)
    except Exception as exc:  # not capturable: host overhead included
        print(f"# graph capture failed ({type(exc).__name__}); do_bench", file=sys.stderr)
        import triton.testing
        return float(triton.testing.do_bench(fn, rep=rep, return_mode="median"))
    times = ([], [])
    for _ in range(7):
        for g, ts in zip(graphs, times):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
    med = [sorted(ts)[len(ts) // 2] for ts in times]
    del graphs
    return max(med[0] - med[1], 1e-6) / n


def tflops(m, k, n, ms):
    return 2.0 * m * k * n / (ms * 1e-3) / 1e12


def candidates(m: int, segments: int):
    """Sweep grid: launch configurations worth trying at this M (none changes the numbers)."""
    C = MMConfig
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        # the swapped Gluon kernel: weight rows on the wgmma M side, the batch's rows as two chunks on its N side
        splits = (0, ) if segments == 1 else (2, 4)
        swapped = [C(0, bn, w, st, gluon=True, swap_ab=True, seg_per_prog=s)
                   for bn, w, st in ((64, 4, 8), (64, 4, 12), (128, 8, 6)) for s in splits]
        if segments == 1:
            return [C(bm, bn, 4, st) for bn in (32, 64, 128) for st in (4, 6)] + swapped
        out = [C(bm, bn, 4, st, seg_per_prog=s) for bn in (32, 64) for st in (4, 6) for s in (1, 2)]
        return out + [C(bm, bn, 4, st, pairs=True) for bn in (32, 64) for st in (2, 3)] + swapped
    if segments > 1:
        swapped = [C(0, bn, w, st, gluon=True, swap_ab=True, seg_per_prog=s)
                   for bn, w, st in ((128, 8, 5), (64, 4, 6)) for s in (2, 4)] if m <= 256 else []
        gluon = swapped + [C(128, 128, 8, 4, gluon=True), C(128, 128, 8, 5, gluon=True), C(128, 64, 4, 4, gluon=True),
                 C(128, 128, 8, 5, gluon=True, tma_store=True), C(64, 128, 4, 6, gluon=True, tma_store=True),
                 C(64, 128, 4, 6, gluon=True), C(128, 128, 8, 5, gluon=True, seg_per_prog=4),
                 C(64, 128, 4, 6, gluon=True, seg_per_prog=4), C(128, 128, 8, 5, gluon=True, seg_per_prog=2),
                 C(64, 128, 4, 6, gluon=True, seg_per_prog=2)]
        if 128 < m <= 256:  # x's rows on the wgmma M side, 96 output columns as 64 + 32
            gluon += [C(bm, 96, w, st, gluon=True, weight_chunks=(64, 32), seg_per_prog=s)
                      for bm, w, st in ((128, 8, 5), (64, 4, 6)) for s in (2, 4)]
        if m <= 256:  # decode-sized M (Hopper): whole-batch row tiles, narrow columns, the tree split over programs
            return gluon + [C(256, 64, 8, 4, gluon=True), C(256, 64, 8, 4, gluon=True, seg_per_prog=4),
                            C(256, 64, 8, 3, gluon=True, seg_per_prog=2), C(128, 64, 4, 6, gluon=True, seg_per_prog=4),
                            C(64, 64, 4, 8, gluon=True, seg_per_prog=4), C(64, 64, 4, 8, gluon=True, seg_per_prog=2)]
        return gluon + [
                C(128, 128, 8, 3, pairs=True), C(128, 128, 8, 3, pairs=True, hold=False),
                C(64, 128, 4, 3, pairs=True), C(64, 128, 4, 2, pairs=True, ctas_per_sm=2),
                C(128, 64, 4, 3, pairs=True), C(128, 64, 4, 2, pairs=True, ctas_per_sm=2),
                C(64, 256, 8, 2, pairs=True, hold=False), C(64, 64, 4, 3, pairs=True),
                C(128, 128, 8, 4, seg_per_prog=8, tma=True, flatten=False), C(64, 128, 4, 4, seg_per_prog=2)] + [
                C(bm, bn, w, st, seg_per_prog=8, tma=True, ctas_per_sm=c)
                for bm, bn, w, c in ((128, 128, 8, 1), (128, 64, 4, 2), (128, 64, 8, 1), (64, 128, 4, 2))
                for st in (3, 4)]
    out = [C(128, 256, 8, 3, tma=True), C(128, 256, 8, 4, tma=True), C(128, 128, 8, 4, tma=True),
           C(128, 128, 4, 4, tma=True), C(128, 128, 4, 5, gluon=True, tma_store=True),
           C(128, 128, 8, 5, gluon=True, tma_store=True), C(64, 128, 4, 6, gluon=True, tma_store=True)]
    if m > 256:
        out += [C(128, 256, 8, 3, gluon=True, tma_store=True, group_m=g) for g in (8, 16)]
        # prefill-sized M: tiles of 192 (3 x 64) or 320 (5 x 64) rows, as cuBLAS's 192 x 192 and 320 x 128
        out += [C(64, bn, w, st, gluon=True, tma_store=True, row_chunks=rc)
                for bn, w, st, rc in ((256, 8, 3, 3), (128, 4, 4, 3), (128, 8, 4, 3), (128, 8, 3, 5))]
    if m <= 512:
        out += [C(64, 64, 4, 4), C(128, 64, 4, 4), C(128, 128, 4, 4)]
    if m <= 256:  # decode-sized M: one row tile for the whole batch, or narrow column tiles
        out += [C(256, 64, 8, 4, gluon=True, tma_store=True), C(256, 128, 8, 3, gluon=True, tma_store=True),
                C(256, 128, 8, 3, gluon=True), C(128, 256, 8, 3, gluon=True, tma_store=True),
                C(128, 256, 8, 3, gluon=True, tma_store=True, group_m=16), C(64, 256, 4, 4, gluon=True, tma_store=True),
                C(128, 64, 4, 6, gluon=True, tma_store=True), C(64, 64, 4, 8, gluon=True, tma_store=True),
                C(128, 128, 8, 3), C(256, 64, 8, 3), C(256, 128, 8, 3, tma=True)]
    if m <= 256:  # the batch's rows on the wgmma N side (two power-of-two chunks, e.g. 128 + 8)
        out += [C(0, bn, w, st, gluon=True, swap_ab=True)
                for bn, w, st in ((128, 8, 4), (128, 8, 5), (64, 4, 6), (64, 4, 8), (128, 4, 4))]
    if 128 < m <= 256:  # x's rows on the wgmma M side, a tile's weight rows on its N side as two chunks
        out += [C(bm, sum(ch), w, st, gluon=True, weight_chunks=ch)
                for bm, ch, w, st in ((128, (64, 32), 4, 6), (128, (64, 32), 8, 6), (128, (64, 32), 4, 8),
                                      (64, (64, 32), 4, 8), (128, (128, 64), 8, 4), (128, (128, 32), 8, 4),
                                      (256, (32, 16), 8, 6), (128, (256, 32), 8, 3))]
    if 128 < m <= 192:  # one 192-row tile (3 x 64) for the whole batch
        out += [C(64, bn, w, st, gluon=True, tma_store=True, row_chunks=3)
                for bn, w, st in ((64, 4, 6), (128, 4, 4), (128, 4, 5), (128, 8, 4), (256, 8, 3))]
    if 192 < m <= 256:  # ... or 256 rows as 4 x 64 (one weight tile feeds four wgmmas)
        out += [C(64, bn, w, st, gluon=True, tma_store=True, row_chunks=4)
                for bn, w, st in ((64, 4, 5), (64, 8, 5), (128, 8, 4))]
    return out


def cfg_dict(cfg: MMConfig):
    return dataclasses.asdict(cfg)


def cfg_label(cfg: MMConfig) -> str:
    """Short name of a launch config: block_m x block_n / warps / stages and the fields set off default."""
    default = MMConfig(cfg.block_m, cfg.block_n, cfg.warps, cfg.stages)
    extra = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
             if getattr(cfg, f.name) != getattr(default, f.name)]
    return " ".join([f"{cfg.block_m}x{cfg.block_n}/{cfg.warps}/{cfg.stages}"] + extra)


def run_matmul(ms_list, sweep: bool, rep: int, shapes=None, model: str = "llama8b"):
    rows, sweep_rows = [], []
    dev = "cuda"
    plan = [(shape, ms_list) for shape in (QWEN_SHAPES if model == "qwen1.5b" else SHAPES)]
    if not sweep and model == "llama8b":
        plan += [(shape, [m for m in TREE_VARIANT_MS if m in ms_list or len(ms_list) > 4]) for shape in TREE_VARIANTS]
    for (name, k, n, segments), shape_ms in plan:
        if shapes and f"{name}/{segments}" not in shapes:
            continue
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        xmax = torch.randn(max(ms_list), k, device=dev, dtype=torch.bfloat16)
        for m in shape_ms:
            x = xmax[:m]
            t_cublas = bench_ms(lambda: torch.matmul(x, w.t()), rep=rep)
            cfg = kt.pick_config(m, n, k, segments)
            t_can = bench_ms(lambda: kt.matmul_with_config(x, w, None, segments, torch.bfloat16, cfg), rep=rep)
            row = {"shape": name, "K": k, "N": n, "M": m, "segments": segments,
                   "canonical_tflops": round(tflops(m, k, n, t_can), 1),
                   "cublas_tflops": round(tflops(m, k, n, t_cublas), 1),
                   "ratio": round(t_cublas / t_can, 3), "config": cfg_dict(cfg)}
            if sweep:
                best, tried = None, {}
                for c in candidates(m, segments):
                    try:
                        t = bench_ms(lambda: kt.matmul_with_config(x, w, None, segments, torch.bfloat16, c),
                                     rep=max(10, rep // 4))
                    except Exception as exc:  # a config that does not compile is just skipped
                        print(f"# {name} M={m} {c}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                        continue
                    tried[cfg_label(c)] = round(t_cublas / t, 3)
                    if best is None or t < best[0]:
                        best = (t, c)
                if best is not None:
                    sweep_rows.append({"shape": name, "M": m, "segments": segments, "best": cfg_dict(best[1]),
                                       "best_ratio": round(t_cublas / best[0], 3),
                                       "best_tflops": round(tflops(m, k, n, best[0]), 1),
                                       "ratio_by_config": tried})
                    print("# sweep", json.dumps(sweep_rows[-1]), file=sys.stderr, flush=True)
            rows.append(row)
            print("#", json.dumps(row), file=sys.stderr, flush=True)
        del w, xmax
        torch.cuda.empty_cache()
    return rows, sweep_rows


def summarize(rows):
    out = {}
    for r in rows:
        key = f"{r['shape']}{'' if r['segments'] == 1 else '/tree' + str(r['segments'])}"
        s = out.setdefault(key, {"min_ratio_M_ge_1024": None, "min_ratio_M_128_512": None, "min_ratio_M_le_64": None})
        band = ("min_ratio_M_ge_1024" if r["M"] >= 1024 else "min_ratio_M_128_512" if r["M"] >= 128
                else "min_ratio_M_le_64")
        s[band] = r["ratio"] if s[band] is None else min(s[band], r["ratio"])
    return out


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


def _paged_decode_case(bsz: int, ctx: int, hq: int, hkv: int, d: int = 128, page: int = 16, max_len: int = 4096):
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
        q, kc, vc, pos, table = _paged_decode_case(bsz, ctx, hq, hkv)
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


# Decode steps of the speed tables (Llama-3.1-8B: 32 query heads on 8 KV heads; Qwen2.5-1.5B: 12 on 2),
# (batch, context, q heads, KV heads, cache capacity = the workload's max_model_len)
DECODE_CASES = ((256, 560, 32, 8, 1040), (256, 1000, 32, 8, 1040), (128, 1000, 32, 8, 1040),
                (160, 1000, 32, 8, 1040), (200, 1000, 32, 8, 1040), (232, 1000, 32, 8, 1040), (64, 1000, 32, 8, 1040),
                (64, 1000, 12, 2, 1040), (256, 1000, 12, 2, 1040), (32, 4096, 32, 8, 9232),
                (32, 8192, 32, 8, 9232), (32, 8192, 12, 2, 9232),
                # around the schedule's switch at one (sequence, KV head) pair per SM (132 on H100)
                (17, 4096, 32, 8, 9232), (24, 4096, 32, 8, 9232), (72, 1000, 12, 2, 1040), (96, 1000, 12, 2, 1040),
                (160, 1000, 12, 2, 1040))


# (BLOCK_M, warps, stages) tried per decode case: 16-row tiles (mma.sync, K and V in registers). 32- and
# 64-row wgmma tiles took 1.11-1.63x the 16-row tile's time (bench/results/2026-11-27-h100-mlp-chunks).
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
        q, kc, vc, pos, table = _paged_decode_case(bsz, ctx, hq, hkv, max_len=capacity + (-capacity) % 16)
        call = lambda: kt.attention(q, kc, vc, pos, block_table=table)  # noqa: E731
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


def run_norms(rep: int):
    dev = "cuda"
    out = {"rms_norm": [], "log_softmax": []}
    n = 4096
    w = torch.randn(n, device=dev, dtype=torch.bfloat16)
    for m in (1, 64, 1024, 8192):
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        t_can = bench_ms(lambda: kt.rms_norm(x, w, 1e-5), rep=rep)
        t_torch = bench_ms(lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-5), rep=rep)
        out["rms_norm"].append({"M": m, "N": n, "canonical_ms": round(t_can, 4), "torch_ms": round(t_torch, 4),
                                "ratio": round(t_torch / t_can, 3)})
    v = 128256
    for m in (1, 64, 1024, 8192):
        x = torch.randn(m, v, device=dev, dtype=torch.float32)
        t_can = bench_ms(lambda: kt.log_softmax(x), rep=rep)
        t_torch = bench_ms(lambda: torch.log_softmax(x, dim=-1), rep=rep)
        out["log_softmax"].append({"M": m, "V": v, "canonical_ms": round(t_can, 4), "torch_ms": round(t_torch, 4),
                                   "ratio": round(t_torch / t_can, 3)})
        del x
    return out


def run_host_overhead():
    """Wall time per call of back-to-back small launches (host-bound: Python + Triton launch)."""
    dev = "cuda"
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device=dev, dtype=torch.bfloat16)
    wo = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    nw = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    calls = {"matmul_qkv_M1": lambda: kt.matmul(x, w), "matmul_o_tree8_M1": lambda: kt.matmul(x, wo, segments=8),
             "rms_norm_M1": lambda: kt.rms_norm(x, nw, 1e-5), "cublas_qkv_M1": lambda: torch.matmul(x, w.t()),
             "torch_rms_norm_M1": lambda: torch.nn.functional.rms_norm(x, (4096,), nw, 1e-5)}
    out = {}
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        out[name + "_us_per_call"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer M values and shorter timing")
    ap.add_argument("--sweep", action="store_true", help="time a grid of launch configs per (shape, M)")
    ap.add_argument("--only", choices=["matmul", "attention", "decode", "norms"], action="append")
    ap.add_argument("--shapes", help="matmul shapes to run, e.g. o/8,down/8 (name/segments)")
    ap.add_argument("--model", default="llama8b", choices=["llama8b", "qwen1.5b"], help="matmul shapes")
    ap.add_argument("--ms", help="matmul M values, e.g. 512,2048,8192")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    rep = 40 if args.quick else 100
    ms_list = [1, 64, 512, 4096] if args.quick else MS
    if args.ms:
        ms_list = [int(m) for m in args.ms.split(",")]
    only = set(args.only or ["matmul", "attention", "norms"])
    t0 = time.time()
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__}
    if "matmul" in only:
        rows, sweep_rows = run_matmul(ms_list, args.sweep, rep, args.shapes and args.shapes.split(","), args.model)
        doc["matmul_summary"] = summarize(rows)
        doc["matmul"] = rows
        if args.sweep:
            doc["sweep"] = sweep_rows
    if "attention" in only:
        doc["attention"] = run_attention(rep)
        if args.sweep:
            doc["attention_sweep"] = run_attention_sweep(rep)
    if "decode" in only:  # not in the default set: a sweep, about a minute
        doc["decode_attention"] = run_decode_attention(rep)
    if "norms" in only:
        doc.update(run_norms(rep))
        doc["host_overhead"] = run_host_overhead()
    doc["seconds"] = round(time.time() - t0, 1)
    emit(doc, args.out)


if __name__ == "__main__":
    main()
