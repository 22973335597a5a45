"""Canonical causal GQA attention over contiguous or paged KV.

For every query row, keys are cut into splits of SPLIT_KV positions from position 0; inside a split
they are visited in blocks of BLOCK_KV positions with an fp32 online softmax from a fresh state and P
cast to bf16 before P @ V, and the splits' states are merged in order (`_merge`). Nothing else about
the launch touches a row's numbers:
- the rows of a program are (token, query head) pairs of one sequence and one KV head; how many there
  are (a whole sequence, a prefill chunk, a verify window or one decode step) only picks the tile
  height, and tensor-core results do not depend on tile shapes (see matmul.py);
- the softmax denominator is also taken on the tensor cores (P @ e0, e0 = first unit column) instead
  of a tree reduction whose order would follow the register layout of the tile;
- blocks or splits where a row sees no key (a longer neighbour row) leave its state exactly as it was;
- paged and contiguous KV differ only in how a key's address is found;
- a tile walks its splits in one program (prefill, training, decode steps with enough sequences to
  fill the GPU), or one program per split writes the split's state and a second kernel merges them
  (other decode steps: split-KV, parallel over long contexts); both run the same `_attend_split` and
  `_merge` code, in the same order.
GPU and CPU results differ (exp2 instead of exp, bf16 P in the denominator); each is invariant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import TRITON, check_attention_blocks
from .device import current_sms

# KV block visited per step, from position 0 (the contract's, kernels.contract.TRITON). It need not
# divide the paged block size: each key's page is looked up on its own.
BLOCK_KV = TRITON.attention_block_kv
SPLIT_KV = TRITON.attention_split_kv
_LOG2E = 1.4426950408889634
_PARALLEL_SPLIT_ROWS = 16  # query rows per (sequence, KV head) up to which a step is decode-sized
# Split states are sized for the cache's capacity (the block table's width: no host sync, so a
# captured step fits any length); past this the tile walks its splits instead (same bits, slower).
_MAX_SPLIT_STATE_BYTES = 256 << 20


@triton.jit
def _rows(pos_ptr, qstart_ptr, qlen_ptr, b, kvh, tile, T, G, sp_b, sp_t, BLOCK_M: tl.constexpr,
          PACKED: tl.constexpr):
    """A tile's rows: (token, query head) pairs of sequence b and KV head kvh, each row's token index
    along the T axis (PACKED: sequence b's queries are the rows qstart[b] .. qstart[b] + qlen[b] - 1 of
    one flat batch, and the b strides are 0), and their positions."""
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // G
    h = kvh * G + r % G
    if PACKED:
        rmask = t < tl.load(qlen_ptr + b)
        tok = tl.load(qstart_ptr + b).to(tl.int64) + t
    else:
        rmask = r < T * G
        tok = t.to(tl.int64)
    pos = tl.load(pos_ptr + b * sp_b + tok * sp_t, mask=rmask, other=-1).to(tl.int32)
    return r, rmask, tok, h, pos


@triton.jit
def _attend_split(q, pos, pmax, blk_lo, blk_hi, k_ptr, v_ptr, table_ptr, b64, kvh, L, BS, qk_scale,
                  sk_page, sk_pos, sk_h, sv_page, sv_pos, sv_h, st_b, d, dmask,
                  HAS_TABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  OFFSETS_32: tl.constexpr):
    """Online softmax from a fresh state over KV blocks [blk_lo, blk_hi): (max, denominator, P @ V).
    OFFSETS_32: every K/V element lies within 2**31 elements of k_ptr / v_ptr, so key addresses are
    32-bit offsets (fewer registers a thread; addresses only, the numbers are the same)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_acc = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    e0 = (tl.zeros([BLOCK_N, 16], dtype=tl.float32) + tl.where(tl.arange(0, 16) == 0, 1.0, 0.0)[None, :])
    e0 = e0.to(tl.bfloat16)
    for blk in range(blk_lo, blk_hi):
        j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = j <= pmax  # keys past every row's position may be stale: never read them
        if HAS_TABLE:
            page = tl.load(table_ptr + b64 * st_b + j // BS, mask=kv_ok, other=0)
            slot = j % BS
        else:
            kv_ok = kv_ok & (j < L)
            page = tl.zeros([BLOCK_N], dtype=tl.int64) + b64
            slot = j
        if OFFSETS_32:
            page = page.to(tl.int32)
        else:
            page = page.to(tl.int64)
            slot = slot.to(tl.int64)
        kvmask = kv_ok[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (page * sk_page + slot * sk_pos + kvh * sk_h)[:, None] + d[None, :],
                    mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 units
        vis = j[None, :] <= pos[:, None]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # no visible key in this block: m_new == m_i, alpha == 1 and p == 0, so the state is unchanged
        alpha = tl.where(m_new == m_i, 1.0, tl.math.exp2(m_i - m_new))
        p = tl.where(vis, tl.math.exp2(s - m_new[:, None]), 0.0).to(tl.bfloat16)
        v = tl.load(v_ptr + (page * sv_page + slot * sv_pos + kvh * sv_h)[:, None] + d[None, :],
                    mask=kvmask, other=0.0)
        l_acc = tl.dot(p, e0, l_acc * alpha[:, None])
        acc = tl.dot(p, v, acc * alpha[:, None])
        m_i = m_new
    return m_i, tl.sum(l_acc, axis=1), acc  # only column 0 of l_acc is non-zero: the sum is exact


@triton.jit
def _merge(m_tot, den_tot, acc_tot, m, den, acc):
    """Fold a split's state into the running one. Weights are exactly 1 for the larger max and 0 for
    an empty side (max -inf), so the first split is taken as is and empty ones change nothing; the
    explicit fma fixes the rounding whatever the compiler would contract."""
    m_new = tl.maximum(m_tot, m)
    a = tl.where(m_tot == m_new, 1.0, tl.math.exp2(m_tot - m_new))
    b = tl.where(m == m_new, 1.0, tl.math.exp2(m - m_new))
    return m_new, tl.fma(den, b, den_tot * a), tl.fma(acc, b[:, None], acc_tot * a[:, None])


@triton.jit
def _store_rows(out_ptr, acc, den, pos, b64, tok, h, rmask, d, dmask, so_b, so_t, so_h, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr):
    den = tl.where(den > 0, den, 1.0)
    o = tl.math.div_rn(acc, tl.broadcast_to(den[:, None], (BLOCK_M, BLOCK_D)))
    o = tl.where((pos >= 0)[:, None], o, 0.0) + 0.0  # + 0.0: one sign for zero
    tl.store(out_ptr + b64 * so_b + tok[:, None] * so_t + h[:, None] * so_h + d[None, :],
             o.to(tl.bfloat16), mask=rmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["T", "L", "BS"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, out_ptr, ps_ptr, qstart_ptr, qlen_ptr, T, G, HKV,
                      L, BS, qk_scale, sq_b, sq_t, sq_h, sk_page, sk_pos, sk_h, sv_page, sv_pos, sv_h,
                      so_b, so_t, so_h, sp_b, sp_t, st_b, ps_bh, ps_r, ps_s,
                      HAS_TABLE: tl.constexpr, PARALLEL_SPLITS: tl.constexpr, PACKED: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLIT_BLOCKS: tl.constexpr, OFFSETS_32: tl.constexpr):
    """PARALLEL_SPLITS=False: a tile walks all its splits and writes the rows. True: program (bh, tile,
    split) reduces one split; rows with a single split are written here, the others leave their
    split's state in ps_ptr ([B * HKV, T * G, splits, BLOCK_D + 2] fp32: acc, max, denominator)."""
    n_tiles = tl.cdiv(T * G, BLOCK_M)
    bh = tl.program_id(0)  # (batch, kv head) on the grid's x axis: y and z stop at 65,535
    tile = n_tiles - 1 - tl.program_id(1)  # causal: the longest rows first
    b = bh // HKV
    kvh = bh % HKV
    r, rmask, tok, h, pos = _rows(pos_ptr, qstart_ptr, qlen_ptr, b, kvh, tile, T, G, sp_b, sp_t, BLOCK_M, PACKED)
    pmax = tl.max(pos, axis=0)
    n_blocks = (pmax + BLOCK_N) // BLOCK_N  # blocks up to the one holding the tile's last position
    if PARALLEL_SPLITS:
        split = tl.program_id(2)
        blk_lo = split * SPLIT_BLOCKS
        if blk_lo >= tl.maximum(n_blocks, 1):  # past every row's keys (split 0 always runs: padding rows)
            return
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    if D == BLOCK_D:  # let the compiler see the full-width rows (vector loads)
        dmask = tl.full([BLOCK_D], 1, dtype=tl.int1)
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * sq_b + tok[:, None] * sq_t + h[:, None] * sq_h + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m_tot = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    den_tot = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_tot = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if PARALLEL_SPLITS:
        m, den, acc = _attend_split(q, pos, pmax, blk_lo, tl.minimum(blk_lo + SPLIT_BLOCKS, n_blocks), k_ptr, v_ptr,
                                  table_ptr, b64, kvh, L, BS, qk_scale, sk_page, sk_pos, sk_h, sv_page, sv_pos,
                                  sv_h, st_b, d, dmask, HAS_TABLE, BLOCK_M, BLOCK_D, BLOCK_N, OFFSETS_32)
        single = pos < SPLIT_BLOCKS * BLOCK_N  # the row's keys fit in split 0: its result is final
        if split == 0:
            m_tot, den_tot, acc_tot = _merge(m_tot, den_tot, acc_tot, m, den, acc)
            _store_rows(out_ptr, acc_tot, den_tot, pos, b64, tok, h, rmask & single, d, dmask, so_b, so_t, so_h,
                        BLOCK_M, BLOCK_D)
        keep = rmask & (pos >= split * SPLIT_BLOCKS * BLOCK_N) & (pos >= SPLIT_BLOCKS * BLOCK_N)
        base = ps_ptr + bh.to(tl.int64) * ps_bh + r.to(tl.int64) * ps_r + split * ps_s
        tl.store(base[:, None] + d[None, :], acc, mask=keep[:, None])
        tl.store(base + BLOCK_D, m, mask=keep)
        tl.store(base + BLOCK_D + 1, den, mask=keep)
    else:
        for blk_lo in range(0, n_blocks, SPLIT_BLOCKS):
            m, den, acc = _attend_split(q, pos, pmax, blk_lo, tl.minimum(blk_lo + SPLIT_BLOCKS, n_blocks), k_ptr,
                                      v_ptr, table_ptr, b64, kvh, L, BS, qk_scale, sk_page, sk_pos, sk_h, sv_page,
                                      sv_pos, sv_h, st_b, d, dmask, HAS_TABLE, BLOCK_M, BLOCK_D, BLOCK_N, OFFSETS_32)
            m_tot, den_tot, acc_tot = _merge(m_tot, den_tot, acc_tot, m, den, acc)
        _store_rows(out_ptr, acc_tot, den_tot, pos, b64, tok, h, rmask, d, dmask, so_b, so_t, so_h, BLOCK_M, BLOCK_D)


@triton.jit(do_not_specialize=["T"])
def _merge_splits_kernel(pos_ptr, out_ptr, ps_ptr, qstart_ptr, qlen_ptr, T, G, HKV, so_b, so_t, so_h, sp_b, sp_t,
                         ps_bh, ps_r, ps_s, PACKED: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    """Rows with more than one split: their splits' states merged in order, then written."""
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = bh // HKV
    kvh = bh % HKV
    r, rmask, tok, h, pos = _rows(pos_ptr, qstart_ptr, qlen_ptr, b, kvh, tile, T, G, sp_b, sp_t, BLOCK_M, PACKED)
    rmask = rmask & (pos >= SPLIT_KEYS)
    n_splits = tl.max(tl.where(rmask, pos, -1), axis=0) // SPLIT_KEYS + 1
    if n_splits <= 1:
        return
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    m_tot = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    den_tot = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_tot = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    base = ps_ptr + bh.to(tl.int64) * ps_bh + r.to(tl.int64) * ps_r
    for split in range(0, n_splits):
        has = rmask & (pos >= split * SPLIT_KEYS)  # a row's splits past its position are empty
        acc = tl.load(base[:, None] + split * ps_s + d[None, :], mask=has[:, None], other=0.0)
        m = tl.load(base + split * ps_s + BLOCK_D, mask=has, other=float("-inf"))
        den = tl.load(base + split * ps_s + BLOCK_D + 1, mask=has, other=0.0)
        m_tot, den_tot, acc_tot = _merge(m_tot, den_tot, acc_tot, m, den, acc)
    _store_rows(out_ptr, acc_tot, den_tot, pos, b.to(tl.int64), tok, h, rmask, d, dmask, so_b, so_t, so_h,
                BLOCK_M, BLOCK_D)


def _tile_config(rows: int, block_d: int):
    """(BLOCK_M, warps, stages) by the number of query rows per (sequence, KV head). Prefill tiles take
    three pipeline stages, the fastest of the swept tiles at both Llama-3.1-8B's and Qwen2.5-1.5B's heads
    (`python -m bench.kernels --sweep`; bench/results/2026-11-27-h100-prefill-attention); heads wider
    than 128 keep two, because three would not fit in shared memory."""
    if rows <= 16:
        return 16, 4, 4
    if rows <= 64:
        return 64, 4, 3
    return 128, 8, 3 if block_d <= 128 else 2


def _decode_schedule(pairs: int):
    """(a program per split?, (BLOCK_M, warps, stages)) for a decode-sized step by its (sequence, KV
    head) pairs: shapes only, so a captured step keeps its choice. Both schedules give the same bits.
    One program per pair walking its splits saves the split states and the merge kernel; with two
    stages (the next block's K and V loaded while this one is reduced) it is the faster one from 1.5
    pairs per SM. Below that, a program per split keeps the SMs busy, on 4 warps, the tile closest to
    the best in every swept case. The switch point and the tiles are what `python -m bench.kernels
    --only decode` measured on both sides of it (bench/results/2026-11-27-h100-decode-offsets)."""
    if 2 * pairs >= 3 * current_sms():
        return False, (16, 2, 2)
    return True, (16, 4, 2)


_OFFSETS_32_LIMIT = 2 ** 31 - 1  # largest K/V view span for 32-bit key offsets (tests and bench lower it)


def _span(t: torch.Tensor) -> int:
    """Elements from t's first to its last addressed element, plus one."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


_FORCED_TILE = None  # tests: force (BLOCK_M, warps, stages) for every call
_FORCED_PARALLEL_SPLITS = None  # tests: force (True) or forbid (False) one program per split


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              block_table: torch.Tensor | None = None, scale: float | None = None,
              block_kv: int = BLOCK_KV, split_kv: int = SPLIT_KV) -> torch.Tensor:
    """Same semantics as kernels.reference.attention, for the Triton family's block_kv only (split_kv:
    any multiple of it)."""
    bsz, tq, hq, d = q.shape
    out = torch.empty(bsz, tq, hq, d, dtype=torch.bfloat16, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    _launch(q, q.stride()[:3], k, v, positions, positions.stride()[:2], block_table, out, out.stride()[:3],
            bsz, tq, scale, block_kv, split_kv)
    return out


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     block_table: torch.Tensor, query_start: torch.Tensor, query_len: torch.Tensor,
                     max_query_len: int, out: torch.Tensor, scale: float | None = None,
                     block_kv: int = BLOCK_KV, split_kv: int = SPLIT_KV) -> torch.Tensor:
    """kernels.reference.attention_packed: the sequences' query rows read from and written to the flat
    q and out [N, Hq, D] in place (no padded copy), each row's numbers those of `attention`."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    _launch(q, (0, q.stride(0), q.stride(1)), k, v, positions, (0, positions.stride(0)), block_table, out,
            (0, out.stride(0), out.stride(1)), query_start.shape[0], max_query_len, scale, block_kv, split_kv,
            packed=(query_start, query_len))
    return out


def _launch(q, q_strides, k, v, positions, pos_strides, block_table, out, out_strides, bsz: int, tq: int,
            scale, block_kv: int, split_kv: int, packed=None) -> None:
    """Fill out's rows: bsz sequences of up to tq query rows each; *_strides are (sequence, row[, head])."""
    if block_kv != BLOCK_KV:
        raise ValueError(f"the Triton attention visits KV in blocks of {BLOCK_KV} (kernels.contract.TRITON), "
                         f"got block_kv={block_kv}")
    check_attention_blocks(block_kv, split_kv)
    hq, d = q.shape[-2:]
    hkv = k.shape[2]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if block_table is not None:
        table, st_b, length, bs = block_table, block_table.stride(0), 0, k.shape[1]
        capacity = block_table.shape[1] * bs
    else:
        table, st_b, length, bs = positions, 0, k.shape[1], 1
        capacity = length
    # the choice follows shapes only (no host sync; a captured decode step keeps it): decode-sized
    # tiles over a cache that can hold more than one split take the decode schedule
    block_d = max(16, triton.next_power_of_2(d))
    n_splits = triton.cdiv(max(capacity, 1), split_kv)
    state_bytes = bsz * hkv * tq * g * n_splits * (block_d + 2) * 4
    parallel, tile = False, _tile_config(tq * g, block_d)
    if tq * g <= _PARALLEL_SPLIT_ROWS and 1 < n_splits:
        parallel, tile = _decode_schedule(bsz * hkv)
        if parallel and state_bytes > _MAX_SPLIT_STATE_BYTES:
            parallel, tile = False, _tile_config(tq * g, block_d)
    if _FORCED_PARALLEL_SPLITS is not None:
        parallel = _FORCED_PARALLEL_SPLITS and n_splits > 1
    block_m, warps, stages = _FORCED_TILE or tile
    n_tiles = triton.cdiv(tq * g, block_m)
    if parallel:
        states = torch.empty(bsz * hkv, tq * g, n_splits, block_d + 2, dtype=torch.float32, device=q.device)
        ps = (states.stride(0), states.stride(1), states.stride(2))
    else:
        states, ps = out, (0, 0, 0)
    qstart, qlen = packed if packed is not None else (positions, positions)  # unread unless packed
    grid = (bsz * hkv, n_tiles, n_splits if parallel else 1)
    _attention_kernel[grid](
        q, k, v, positions, table, out, states, qstart, qlen, tq, g, hkv, length, bs, float(scale) * _LOG2E,
        *q_strides, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *out_strides, *pos_strides, st_b, *ps,
        HAS_TABLE=block_table is not None, PARALLEL_SPLITS=parallel, PACKED=packed is not None, D=d,
        BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=BLOCK_KV, SPLIT_BLOCKS=split_kv // BLOCK_KV,
        OFFSETS_32=max(_span(k), _span(v)) <= _OFFSETS_32_LIMIT, num_warps=warps, num_stages=stages)
    if parallel:
        _merge_splits_kernel[(bsz * hkv, n_tiles)](
            positions, out, states, qstart, qlen, tq, g, hkv, *out_strides, *pos_strides, *ps,
            PACKED=packed is not None, D=d, BLOCK_D=block_d, BLOCK_M=block_m, SPLIT_KEYS=split_kv, num_warps=4)


@triton.jit(do_not_specialize=["N"])
def _write_kv_kernel(k_ptr, v_ptr, kp_ptr, vp_ptr, blocks_ptr, offsets_ptr, N,
                     stride_kn, stride_kh, stride_vn, stride_vh,
                     stride_kpb, stride_kpo, stride_kph, stride_vpb, stride_vpo, stride_vph,
                     D: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    mask = idx < HD
    h, d = idx // D, idx % D
    b = tl.load(blocks_ptr + n).to(tl.int64)
    o = tl.load(offsets_ptr + n).to(tl.int64)
    k = tl.load(k_ptr + n * stride_kn + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + n * stride_vn + h * stride_vh + d, mask=mask)
    tl.store(kp_ptr + b * stride_kpb + o * stride_kpo + h * stride_kph + d, k.to(kp_ptr.dtype.element_ty), mask=mask)
    tl.store(vp_ptr + b * stride_vpb + o * stride_vpo + h * stride_vph + d, v.to(vp_ptr.dtype.element_ty), mask=mask)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Both of a layer's cache writes in one launch (a copy: the reference's index_put, same bits).
    Pools [NB, BS, Hkv, D] may be strided views (vLLM's layouts); k, v [N, Hkv, D] with unit stride in D."""
    n, hkv, d = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        from kernels.reference import ops
        return ops.write_kv(k_pool, v_pool, blocks, offsets, k, v)
    if n == 0:
        return
    _write_kv_kernel[(n,)](k, v, k_pool, v_pool, blocks, offsets, n, k.stride(0), k.stride(1), v.stride(0),
                           v.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3], D=d, HD=hkv * d,
                           BLOCK=triton.next_power_of_2(hkv * d), num_warps=4)
