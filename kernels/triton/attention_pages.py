"""Decode attention reading paged K/V by TMA, one 16-token page at a time (a candidate, not yet used).

Same numbers as `attention` for a decode step over a 16-token-page cache: the same blocks of
BLOCK_KV keys, splits and merge. Each block's four pages are loaded by the copy engine (no per-key
address registers), and its products are four chained dots of 16 keys each: a 64-key dot is four
k = 16 tensor-core steps in key order, so chaining them by page gives the same sums. K and V then
live in registers a page at a time. Compiled for sm_90 (Triton 3.6, Llama-3.1-8B heads), registers
a thread (`attention`'s decode tile: 254-255, 4 programs of 2 warps per SM):

| schedule | 2 warps, 1 stage | 2 warps, 2 stages | 4 warps, 1 stage | 4 warps, 2 stages |
|---|---|---|---|---|
| walking the splits | 199 | 204 | 158 | 165 |
| a program per split | 191 | 166 | 140 | 128 |
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .attention import BLOCK_KV, SPLIT_KV, _LOG2E, _merge, _merge_splits_kernel, _rows, _store_rows

PAGE = 16  # tokens per cache page this kernel reads (vLLM's default block size)


@triton.jit
def _page_scores(q, k_desc, table_ptr, b64, st_b, first, base, i: tl.constexpr, pmax, col, pos, qk_scale,
                 PAGE: tl.constexpr):
    """(page id, scaled scores with -inf where a row must not see the key) of page i of the block at
    key `base`; a page past every row's position reads the block's first page instead (never used)."""
    page = first
    if i > 0:
        page = tl.load(table_ptr + b64 * st_b + base // PAGE + i, mask=base + i * PAGE <= pmax, other=first)
    k = k_desc.load([page * PAGE, col])
    j = base + i * PAGE + tl.arange(0, PAGE)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    return page, tl.where(j[None, :] <= pos[:, None], s, float("-inf"))


@triton.jit
def _page_update(l_acc, acc, s, m_new, v_desc, page, base, i: tl.constexpr, pmax, pos, col, e0,
                 PAGE: tl.constexpr):
    """Fold page i into the block's (denominator, P @ V) chain; V rows past every position are zero
    (stale cache slots may hold anything, NaN included)."""
    j = base + i * PAGE + tl.arange(0, PAGE)
    p = tl.where(j[None, :] <= pos[:, None], tl.math.exp2(s - m_new[:, None]), 0.0).to(tl.bfloat16)
    v = v_desc.load([page * PAGE, col])
    v = tl.where((j <= pmax)[:, None], v, 0.0)
    return tl.dot(p, e0, l_acc), tl.dot(p, v, acc)


@triton.jit
def _attend_split_pages(q, pos, pmax, blk_lo, blk_hi, k_desc, v_desc, table_ptr, b64, kvh, qk_scale, st_b,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    tl.static_assert(BLOCK_N == 4 * PAGE)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_acc = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    e0 = (tl.zeros([PAGE, 16], dtype=tl.float32) + tl.where(tl.arange(0, 16) == 0, 1.0, 0.0)[None, :]).to(tl.bfloat16)
    col = kvh * BLOCK_D
    for blk in range(blk_lo, blk_hi):
        base = blk * BLOCK_N
        first = tl.load(table_ptr + b64 * st_b + base // PAGE)
        p0, s0 = _page_scores(q, k_desc, table_ptr, b64, st_b, first, base, 0, pmax, col, pos, qk_scale, PAGE)
        p1, s1 = _page_scores(q, k_desc, table_ptr, b64, st_b, first, base, 1, pmax, col, pos, qk_scale, PAGE)
        p2, s2 = _page_scores(q, k_desc, table_ptr, b64, st_b, first, base, 2, pmax, col, pos, qk_scale, PAGE)
        p3, s3 = _page_scores(q, k_desc, table_ptr, b64, st_b, first, base, 3, pmax, col, pos, qk_scale, PAGE)
        m_blk = tl.maximum(tl.maximum(tl.max(s0, axis=1), tl.max(s1, axis=1)),
                           tl.maximum(tl.max(s2, axis=1), tl.max(s3, axis=1)))
        m_new = tl.maximum(m_i, m_blk)
        alpha = tl.where(m_new == m_i, 1.0, tl.math.exp2(m_i - m_new))
        l_acc, acc = l_acc * alpha[:, None], acc * alpha[:, None]
        l_acc, acc = _page_update(l_acc, acc, s0, m_new, v_desc, p0, base, 0, pmax, pos, col, e0, PAGE)
        l_acc, acc = _page_update(l_acc, acc, s1, m_new, v_desc, p1, base, 1, pmax, pos, col, e0, PAGE)
        l_acc, acc = _page_update(l_acc, acc, s2, m_new, v_desc, p2, base, 2, pmax, pos, col, e0, PAGE)
        l_acc, acc = _page_update(l_acc, acc, s3, m_new, v_desc, p3, base, 3, pmax, pos, col, e0, PAGE)
        m_i = m_new
    return m_i, tl.sum(l_acc, axis=1), acc


@triton.jit
def _decode_pages_kernel(q_ptr, k_desc, v_desc, pos_ptr, table_ptr, out_ptr, ps_ptr, G, HKV, qk_scale, sq_b, sq_h,
                         so_b, so_t, so_h, sp_b, sp_t, st_b, ps_bh, ps_r, ps_s, D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                         SPLIT_BLOCKS: tl.constexpr, PARALLEL_SPLITS: tl.constexpr):
    """`_attention_kernel` for one decode token per sequence (rows: its G query heads of one KV head):
    walking the splits, or (PARALLEL_SPLITS) one split per program, its state left for the merge kernel
    in the same layout."""
    bh = tl.program_id(0)
    b = bh // HKV
    kvh = bh % HKV
    r, rmask, tok, h, pos = _rows(pos_ptr, pos_ptr, pos_ptr, b, kvh, 0, 1, G, sp_b, sp_t, BLOCK_M, False)
    pmax = tl.max(pos, axis=0)
    n_blocks = (pmax + BLOCK_N) // BLOCK_N
    if PARALLEL_SPLITS:
        split = tl.program_id(2)
        blk_lo = split * SPLIT_BLOCKS
        if blk_lo >= tl.maximum(n_blocks, 1):  # past every row's keys (split 0 always runs: padding rows)
            return
    d = tl.arange(0, D)
    dmask = tl.full([D], 1, dtype=tl.int1)
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * sq_b + h[:, None] * sq_h + d[None, :], mask=rmask[:, None], other=0.0)
    m_tot = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    den_tot = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_tot = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if PARALLEL_SPLITS:
        m, den, acc = _attend_split_pages(q, pos, pmax, blk_lo, tl.minimum(blk_lo + SPLIT_BLOCKS, n_blocks), k_desc,
                                          v_desc, table_ptr, b64, kvh, qk_scale, st_b, BLOCK_M, D, BLOCK_N, PAGE)
        single = pos < SPLIT_BLOCKS * BLOCK_N  # the row's keys fit in split 0: its result is final
        if split == 0:
            m_tot, den_tot, acc_tot = _merge(m_tot, den_tot, acc_tot, m, den, acc)
            _store_rows(out_ptr, acc_tot, den_tot, pos, b64, tok, h, rmask & single, d, dmask, so_b, so_t, so_h,
                        BLOCK_M, D)
        keep = rmask & (pos >= split * SPLIT_BLOCKS * BLOCK_N) & (pos >= SPLIT_BLOCKS * BLOCK_N)
        base = ps_ptr + bh.to(tl.int64) * ps_bh + r.to(tl.int64) * ps_r + split * ps_s
        tl.store(base[:, None] + d[None, :], acc, mask=keep[:, None])
        tl.store(base + D, m, mask=keep)
        tl.store(base + D + 1, den, mask=keep)
    else:
        for blk_lo in range(0, n_blocks, SPLIT_BLOCKS):
            m, den, acc = _attend_split_pages(q, pos, pmax, blk_lo, tl.minimum(blk_lo + SPLIT_BLOCKS, n_blocks),
                                              k_desc, v_desc, table_ptr, b64, kvh, qk_scale, st_b, BLOCK_M, D,
                                              BLOCK_N, PAGE)
            m_tot, den_tot, acc_tot = _merge(m_tot, den_tot, acc_tot, m, den, acc)
        _store_rows(out_ptr, acc_tot, den_tot, pos, b64, tok, h, rmask, d, dmask, so_b, so_t, so_h, BLOCK_M, D)


def decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                 block_table: torch.Tensor, scale: float | None = None, parallel_splits: bool = False,
                 warps: int = 2, stages: int = 1) -> torch.Tensor:
    """`attention(q, k_cache, v_cache, positions, block_table)` for one decode token per sequence:
    q [B, 1, Hq, D], caches [pages, 16, Hkv, D] (each page's rows contiguous), positions [B, 1].
    parallel_splits: a program per split, then `attention`'s merge kernel (else one program walks them)."""
    bsz, tq, hq, d = q.shape
    pages, page, hkv, _ = k_cache.shape
    g = hq // hkv
    if tq != 1 or page != PAGE or d not in (64, 128) or g > 16:
        raise ValueError(f"decode_paged takes one token per sequence over {PAGE}-token pages, head dim 64 or "
                         f"128 and at most 16 query heads per KV head; got q {tuple(q.shape)}, "
                         f"cache {tuple(k_cache.shape)}")
    for c in (k_cache, v_cache):
        if c.stride(-1) != 1 or c.stride(2) != d or c.stride(1) != hkv * d:
            raise ValueError("decode_paged needs each page's [16, Hkv, D] rows contiguous")

    def desc(c):  # the cache as [pages * 16, Hkv * D] rows; a copy reads one page of one KV head
        return TensorDescriptor(c, [pages * page, hkv * d], [c.stride(1), 1], [PAGE, d])
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(bsz, 1, hq, d, dtype=torch.bfloat16, device=q.device)
    scale = d ** -0.5 if scale is None else scale
    n_splits = triton.cdiv(block_table.shape[1] * PAGE, SPLIT_KV)
    parallel = parallel_splits and n_splits > 1
    if parallel:
        states = torch.empty(bsz * hkv, g, n_splits, d + 2, dtype=torch.float32, device=q.device)
        ps = states.stride()[:3]
    else:
        states, ps = out, (0, 0, 0)
    _decode_pages_kernel[(bsz * hkv, 1, n_splits if parallel else 1)](
        q, desc(k_cache), desc(v_cache), positions, block_table, out, states, g, hkv, float(scale) * _LOG2E,
        q.stride(0), q.stride(2), out.stride(0), out.stride(1), out.stride(2), positions.stride(0),
        positions.stride(1), block_table.stride(0), *ps, D=d, BLOCK_M=16, BLOCK_N=BLOCK_KV, PAGE=PAGE,
        SPLIT_BLOCKS=SPLIT_KV // BLOCK_KV, PARALLEL_SPLITS=parallel, num_warps=warps, num_stages=stages)
    if parallel:
        _merge_splits_kernel[(bsz * hkv, 1)](
            positions, out, states, positions, positions, 1, g, hkv, out.stride(0), out.stride(1), out.stride(2),
            positions.stride(0), positions.stride(1), *ps, PACKED=False, D=d, BLOCK_D=d, BLOCK_M=16,
            SPLIT_KEYS=SPLIT_KV, num_warps=4)
    return out
