"""The canonical matmuls against cuBLAS over M: as the launch tables pick them and, with a sweep, over a
grid of launch configurations (which leave the numbers alone)."""
from __future__ import annotations

import dataclasses
import json
import sys

import torch

import kernels.triton as kt
from bench.kernel_timing.timing import bench_ms, tflops
from kernels.triton import MMConfig

# (name, K, N, segments): Llama-3.1-8B projections; QWEN_SHAPES: Qwen2.5-1.5B (`--model qwen1.5b`)
SHAPES = [("qkv", 4096, 6144, 1), ("o", 4096, 4096, 1), ("o", 4096, 4096, 8), ("gate_up", 4096, 28672, 1),
          ("down", 14336, 4096, 1), ("down", 14336, 4096, 8), ("lm_head", 4096, 128256, 1)]
QWEN_SHAPES = [("qkv", 1536, 2048, 1), ("o", 1536, 1536, 8), ("gate_up", 1536, 17920, 1), ("down", 8960, 1536, 8),
               ("lm_head", 1536, 151936, 1)]
MS = [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# Shorter trees (a smaller largest-TP degree) for comparison, at a few M.
TREE_VARIANTS = [("o", 4096, 4096, 2), ("o", 4096, 4096, 4), ("down", 14336, 4096, 2), ("down", 14336, 4096, 4)]
TREE_VARIANT_MS = [64, 512, 2048, 8192]


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
