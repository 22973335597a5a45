"""Canonical matmul: x @ weight.T with fp32 accumulation over K in one fixed order of BLOCK_K tiles.

Per output element the K loop always runs k = 0, 64, 128, ... (within each segment, from the segment
start), each tile folded in by one tensor-core dot into the fp32 accumulator. Tile shapes over M and
N, warps, stages, TMA and persistence are free to change with the shape: measured on H100 they do not
change the per-element reduction, and tests/gpu checks that they don't.

Row-parallel layers use `segments` = S: K is cut into S equal segments, each reduced from zero in
tile order, and the S fp32 partials are added by the fixed tree ((p0+p1)+(p2+p3))+... . A program may
reduce an aligned power-of-two group of segments itself; the group sums then go through the same tree
in a small combine kernel. Since fp32 addition is commutative, a + b and b + a give the same bits,
which lets the kernel keep few tiles alive. On Hopper most products, plain and tree, run in the Gluon
kernels of matmul_sm90.py, which keep the same per-element order (at decode batch sizes often the
swapped one: the batch's rows on the wgmma N side, see token_chunks).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..contract import TRITON
from .device import current_sms, num_sms, wave_fill

# Fixed K tile, the contract's (kernels.contract.TRITON): one dot per BLOCK_K K-elements, in order.
BLOCK_K = TRITON.matmul_block_k


@dataclass(frozen=True)
class MMConfig:
    """Launch configuration; none of these fields changes the numbers (only BLOCK_K would)."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    seg_per_prog: int = 0  # segments one program reduces (power of two, <= 8); 0 = all of them
    group_m: int = 8  # tile-order swizzle for L2 reuse
    tma: bool = False  # persistent kernel with TMA loads (segment ends on BLOCK_K boundaries)
    flatten: bool = True  # TMA kernel: one pipelined loop over (tile, segment)
    ctas_per_sm: int = 1  # TMA kernel: persistent programs per SM
    pairs: bool = False  # whole tree per tile, segments in pairs (TMA; segments in 2, 4, 8)
    hold: bool = True  # pairs kernel: keep the left quarter-tree in registers (else L2 scratch)
    gluon: bool = False  # Hopper: the Gluon kernel (matmul_sm90.py; seg_per_prog splits tiles)
    tma_store: bool = False  # Gluon kernel: epilogue through shared memory and a TMA store
    row_chunks: int = 1  # Gluon plain product: tiles of row_chunks x block_m rows (3 x 64 = 192: no power of two)
    # Gluon: weights on the wgmma M side (block_n rows), x's rows on its N side (token_chunks; block_m unused)
    swap_ab: bool = False
    # Gluon: a tile's block_n weight rows on the wgmma N side as two power-of-two chunks (64 + 32 = 96), x's
    # block_m rows on its M side (matmul_sm90.launch_column_chunks)
    weight_chunks: tuple[int, int] | None = None

    def __post_init__(self):
        if self.weight_chunks and (not self.gluon or sum(self.weight_chunks) != self.block_n):
            raise ValueError(f"weight_chunks {self.weight_chunks} need gluon=True and block_n = their sum "
                             f"(block_n={self.block_n})")


@functools.lru_cache(maxsize=1024)
def token_chunks(m: int) -> tuple[int, int]:
    """The swapped kernel's row tile for a batch of m rows, as two power-of-two chunks (wgmma N sizes):
    the largest power of two below m (at most 128), then the smallest power of two >= 8 covering the
    rest (136 -> 128 + 8, 128 -> 64 + 64, 72 -> 64 + 8; above 256 rows, tiles of 128 + 128)."""
    head = min(128, max(8, 1 << max(m - 1, 1).bit_length() - 1))
    rest = max(m - head, 1)
    return head, min(128, max(8, 1 << (rest - 1).bit_length()))


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped ordering: GROUP_M row tiles share the same run of column tiles (weight reuse in L2)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % width) % gsize)
    pid_n = (pid % width) // gsize
    return pid_m, pid_n


@triton.jit
def _segment_sum(x_ptr, w_ptr, offs_m, offs_n, seg, seg_len, K, stride_xm, stride_xk, stride_wn, stride_wk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] sum over K in [seg*seg_len, min((seg+1)*seg_len, K)), tile by tile."""
    k_lo = seg * seg_len
    k_hi = tl.minimum(k_lo + seg_len, K)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + rk)[None, :] * stride_xk
    b_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + rk)[None, :] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = (k + rk) < k_hi
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K * stride_xk
        b_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _segment_pair(x_ptr, w_ptr, offs_m, offs_n, seg, seg_len, K, stride_xm, stride_xk, stride_wn, stride_wk,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """s(seg) + s(seg + 1): a level-1 node of the tree."""
    acc = _segment_sum(x_ptr, w_ptr, offs_m, offs_n, seg, seg_len, K, stride_xm, stride_xk, stride_wn, stride_wk,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    return acc + _segment_sum(x_ptr, w_ptr, offs_m, offs_n, seg + 1, seg_len, K, stride_xm, stride_xk, stride_wn,
                              stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, scratch_ptr, M, N, K, seg_len,
               stride_xm, stride_xk, stride_wn, stride_wk, stride_og, stride_om, stride_on,
               NSEG: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One output tile; program_id(1) = g reduces segments g*NSEG .. g*NSEG+NSEG-1 by the fixed tree."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # out-of-range rows/cols read a valid row instead (results discarded): no masks in the K loop
    ld_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    ld_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    s0 = g * NSEG
    if NSEG == 1:
        acc = _segment_sum(x_ptr, w_ptr, ld_m, ld_n, s0, seg_len, K, stride_xm, stride_xk, stride_wn, stride_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    elif NSEG == 2:
        acc = _segment_pair(x_ptr, w_ptr, ld_m, ld_n, s0, seg_len, K, stride_xm, stride_xk, stride_wn, stride_wk,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    elif NSEG == 4:
        acc = (_segment_pair(x_ptr, w_ptr, ld_m, ld_n, s0, seg_len, K, stride_xm, stride_xk, stride_wn, stride_wk,
                             BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
               + _segment_pair(x_ptr, w_ptr, ld_m, ld_n, s0 + 2, seg_len, K, stride_xm, stride_xk, stride_wn,
                               stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K))
    else:
        tl.static_assert(NSEG == 8)
        # ((s0+s1)+(s2+s3)) + ((s4+s5)+(s6+s7)) needs four live tiles at the last leaf; keep three in
        # registers and park s6 in this program's own scratch tile.
        r1 = _segment_pair(x_ptr, w_ptr, ld_m, ld_n, s0, seg_len, K, stride_xm, stride_xk, stride_wn, stride_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        r1 = r1 + _segment_pair(x_ptr, w_ptr, ld_m, ld_n, s0 + 2, seg_len, K, stride_xm, stride_xk, stride_wn,
                                stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        r2 = _segment_pair(x_ptr, w_ptr, ld_m, ld_n, s0 + 4, seg_len, K, stride_xm, stride_xk, stride_wn, stride_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        s6 = _segment_sum(x_ptr, w_ptr, ld_m, ld_n, s0 + 6, seg_len, K, stride_xm, stride_xk, stride_wn, stride_wk,
                          BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        tile = (pid + g * tl.num_programs(0)).to(tl.int64) * (BLOCK_M * BLOCK_N)
        sc_ptrs = scratch_ptr + tile + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(sc_ptrs, s6)
        acc = _segment_sum(x_ptr, w_ptr, ld_m, ld_n, s0 + 7, seg_len, K, stride_xm, stride_xk, stride_wn,
                           stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        tl.debug_barrier()  # the store above may come from other threads of this program
        acc = acc + tl.load(sc_ptrs)  # s7 + s6 == s6 + s7
        acc = r1 + (r2 + acc)
    _store_tile(acc, bias_ptr, out_ptr, g, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_og, stride_om, stride_on,
                PARTIAL, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _store_tile(v, bias_ptr, out_ptr, g, off_m, off_n, M, N, stride_og, stride_om, stride_on,
                PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Masked store of an fp32 tile: raw (partials) or + bias and cast to the output dtype."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    o_ptrs = (out_ptr + g.to(tl.int64) * stride_og + offs_m.to(tl.int64)[:, None] * stride_om
              + offs_n[None, :] * stride_on)
    if PARTIAL:
        tl.store(o_ptrs, v, mask=mask)
    else:
        if HAS_BIAS:
            v = v + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptrs, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _mm_tma_kernel(x_desc, w_desc, bias_ptr, out_ptr, scratch_ptr, M, N, K, seg_len, groups,
                   stride_og, stride_om, stride_on,
                   NSEG: tl.constexpr, LOG_NSEG: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr):
    """Persistent, TMA loads. Work items are (output tile, group of NSEG segments); one loop runs over
    (item, segment) so that the copy pipeline does not drain at segment ends. The group's tree is
    built as segments finish: a left leaf waits in registers, higher left nodes in this program's
    scratch slots (L2), so only two accumulator tiles are ever live."""
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    my_items = tl.cdiv(num_tiles * groups - pid, NUM_PROGS)
    seg_tiles = tl.cdiv(seg_len, BLOCK_K)
    slot = (scratch_ptr + pid.to(tl.int64) * (LOG_NSEG * BLOCK_M * BLOCK_N)
            + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    left = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.range(0, my_items * NSEG, flatten=FLATTEN):
        item = pid + (i // NSEG) * NUM_PROGS
        s = i % NSEG
        g = item // num_tiles
        pid_m, pid_n = _tile_ids(item % num_tiles, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        k0 = (g * NSEG + s) * seg_len
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(seg_tiles):
            a = x_desc.load([off_m, k0 + kk * BLOCK_K])
            b = w_desc.load([off_n, k0 + kk * BLOCK_K])
            acc = tl.dot(a, tl.trans(b), acc)
        if NSEG == 1:
            _store_tile(acc, bias_ptr, out_ptr, g, off_m, off_n, M, N, stride_og, stride_om, stride_on,
                          PARTIAL, HAS_BIAS, BLOCK_M, BLOCK_N)
        else:
            if s % 2 == 0:
                left = acc
            else:
                v = left + acc  # level-1 node (left leaf + right leaf)
                for L in tl.static_range(1, LOG_NSEG):
                    low = (1 << L) - 1
                    full = (s & low) == low  # v is a complete level-L node
                    odd = ((s >> L) & 1) == 1  # ... and a right child: add its stored left sibling
                    if full:
                        tl.debug_barrier()  # slot written/read by other threads of this program
                        if odd:
                            v = tl.load(slot + (L - 1) * (BLOCK_M * BLOCK_N)) + v
                        else:
                            tl.store(slot + (L - 1) * (BLOCK_M * BLOCK_N), v)
                if s == NSEG - 1:
                    _store_tile(v, bias_ptr, out_ptr, g, off_m, off_n, M, N, stride_og, stride_om, stride_on,
                                  PARTIAL, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _seg_tile(desc, off, seg, seg_len, kk, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SEG3D: tl.constexpr):
    """[ROWS, BLOCK_K] tile kk of segment seg. SEG3D: the descriptor views the operand as
    [segments, rows, seg_len], so a segment's last partial tile is zero-filled by TMA (like the
    masked loads of _segment_sum) instead of reading into the next segment."""
    if SEG3D:
        t = desc.load([seg, off, kk * BLOCK_K]).reshape(ROWS, BLOCK_K)
    else:
        t = desc.load([off, seg * seg_len + kk * BLOCK_K])
    return t


@triton.jit
def _pair_sum(x_desc, w_desc, off_m, off_n, s0, seg_len, seg_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SEG3D: tl.constexpr):
    """s(s0) + s(s0 + 1): two segments reduced side by side in one pipelined loop, then added."""
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(seg_tiles):
        a0 = _seg_tile(x_desc, off_m, s0, seg_len, kk, BLOCK_M, BLOCK_K, SEG3D)
        b0 = _seg_tile(w_desc, off_n, s0, seg_len, kk, BLOCK_N, BLOCK_K, SEG3D)
        a1 = _seg_tile(x_desc, off_m, s0 + 1, seg_len, kk, BLOCK_M, BLOCK_K, SEG3D)
        b1 = _seg_tile(w_desc, off_n, s0 + 1, seg_len, kk, BLOCK_N, BLOCK_K, SEG3D)
        acc0 = tl.dot(a0, tl.trans(b0), acc0)
        acc1 = tl.dot(a1, tl.trans(b1), acc1)
    return acc0 + acc1


@triton.jit(do_not_specialize=["M"])
def _mm_pairs_kernel(x_desc, w_desc, bias_ptr, out_ptr, scratch_ptr, M, N, K, seg_len,
                     stride_om, stride_on, NSEG: tl.constexpr, HOLD: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr, SEG3D: tl.constexpr):
    """Whole segment tree (NSEG = 2, 4 or 8) per output tile, persistent, TMA loads. Segments go in
    pairs through one loop with two accumulators; the pair sums (level-1 nodes) are combined with
    static control flow: pair 0 waits in registers (HOLD) or in this program's L2 scratch slot,
    pair 2 in the scratch slot, so at most three tiles are live."""
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    seg_tiles = tl.cdiv(seg_len, BLOCK_K)
    slot = (scratch_ptr + pid.to(tl.int64) * (2 * BLOCK_M * BLOCK_N)
            + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    for tile in range(pid, num_tiles, NUM_PROGS):
        pid_m, pid_n = _tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        v = _pair_sum(x_desc, w_desc, off_m, off_n, 0, seg_len, seg_tiles, BLOCK_M, BLOCK_N, BLOCK_K, SEG3D)
        if NSEG >= 4:
            if HOLD:
                q0 = v
            else:
                tl.store(slot, v)
            v = _pair_sum(x_desc, w_desc, off_m, off_n, 2, seg_len, seg_tiles,
                          BLOCK_M, BLOCK_N, BLOCK_K, SEG3D)
            if HOLD:
                v = q0 + v
            else:
                tl.debug_barrier()
                v = tl.load(slot) + v
        if NSEG == 8:
            if HOLD:
                q0 = v
            else:
                tl.debug_barrier()
                tl.store(slot, v)
            v = _pair_sum(x_desc, w_desc, off_m, off_n, 4, seg_len, seg_tiles,
                          BLOCK_M, BLOCK_N, BLOCK_K, SEG3D)
            tl.store(slot + BLOCK_M * BLOCK_N, v)
            v = _pair_sum(x_desc, w_desc, off_m, off_n, 6, seg_len, seg_tiles,
                          BLOCK_M, BLOCK_N, BLOCK_K, SEG3D)
            tl.debug_barrier()
            v = tl.load(slot + BLOCK_M * BLOCK_N) + v
            if HOLD:
                v = q0 + v
            else:
                v = tl.load(slot) + v
        _store_tile(v, bias_ptr, out_ptr, pid * 0, off_m, off_n, M, N, 0, stride_om, stride_on,
                      False, HAS_BIAS, BLOCK_M, BLOCK_N)
        tl.debug_barrier()  # the next tile reuses the scratch slots


@triton.jit
def _part(p_ptr, i, stride_g, offs, mask):
    return tl.load(p_ptr + i * stride_g + offs, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(p_ptr, bias_ptr, out_ptr, M, N, stride_g, stride_pm, stride_om,
                    G: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out = tree(partials) (+ bias), cast: the upper levels of the segment tree."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    offs = row * stride_pm + cols
    if G == 2:
        acc = _part(p_ptr, 0, stride_g, offs, mask) + _part(p_ptr, 1, stride_g, offs, mask)
    elif G == 4:
        acc = ((_part(p_ptr, 0, stride_g, offs, mask) + _part(p_ptr, 1, stride_g, offs, mask))
               + (_part(p_ptr, 2, stride_g, offs, mask) + _part(p_ptr, 3, stride_g, offs, mask)))
    else:
        tl.static_assert(G == 8)
        acc = (((_part(p_ptr, 0, stride_g, offs, mask) + _part(p_ptr, 1, stride_g, offs, mask))
                + (_part(p_ptr, 2, stride_g, offs, mask) + _part(p_ptr, 3, stride_g, offs, mask)))
               + ((_part(p_ptr, 4, stride_g, offs, mask) + _part(p_ptr, 5, stride_g, offs, mask))
                  + (_part(p_ptr, 6, stride_g, offs, mask) + _part(p_ptr, 7, stride_g, offs, mask))))
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Launch tables. Rule: each row is (max_M, config per N column: <= 4096, <= 8192, wider); the first
# row with M <= max_M wins. Tile shapes only change speed, never bits (K is reduced in BLOCK_K order
# whatever the tile), so every row is a measured choice (bench/kernels.py --sweep against cuBLAS; the
# measurements behind each row are in bench/results/README.md, "The matmul launch tables", and the run
# folders it names). Small M
# streams the weight (narrow tiles, deep pipelines, many programs); from M = 128 on Hopper the Gluon
# kernel (matmul_sm90.py) takes most shapes; just above a power of two, row-chunked tiles cover the
# batch without computing a second tile of padding; where output tiles fill the SMs' last wave badly,
# narrower ones (column chunks) fill it.
C = MMConfig
_G64 = C(64, 128, 4, 6, gluon=True, tma_store=True)
_G128 = C(128, 128, 4, 5, gluon=True, tma_store=True)
_G256 = C(128, 256, 8, 3, gluon=True, tma_store=True, group_m=16)
_G64N = C(64, 64, 4, 8, gluon=True, tma_store=True)
_R192 = C(64, 64, 4, 6, gluon=True, tma_store=True, row_chunks=3)
_R192W = C(64, 256, 8, 3, gluon=True, tma_store=True, row_chunks=3)
_COL96 = C(128, 96, 4, 8, gluon=True, weight_chunks=(64, 32))
_PLAIN = [
    (16, (C(16, 64, 4, 6), C(16, 64, 4, 6), C(16, 128, 4, 6))),
    (32, (C(32, 32, 4, 6), C(32, 64, 4, 6), C(32, 64, 4, 6))),
    (64, (C(64, 32, 4, 6), C(64, 32, 4, 6), C(64, 128, 4, 6))),
    (128, (_G64N, _G64, C(128, 256, 8, 4, tma=True))),
    (192, (_G64, _R192, _R192W)),
    (208, (_G64, _G128, C(128, 256, 8, 4, tma=True))),
    (256, (_G64, _COL96, C(128, 256, 8, 4, tma=True))),
    (512, (_G128, C(128, 256, 8, 4, tma=True), _G128)),
    (1024, (C(128, 256, 8, 4, tma=True), _G128, C(128, 256, 8, 4, tma=True))),
    (None, (_G256,) * 3),
]
# Decode-sized batches where the swapped kernel (matmul_sm90.swapped_matmul_kernel: the batch's rows on
# the wgmma N side, the weight's on its M side) beats the tables above; None: the tables above. An
# entry applies only where its work items fill at least _SWAPPED_MIN_FILL of the SMs' waves, because
# below that a wave of idle SMs costs more than the swap saves.
_SWAPPED_MIN_FILL = 0.7
_SW64 = C(0, 64, 4, 8, gluon=True, swap_ab=True)
_SW128 = C(0, 128, 8, 5, gluon=True, swap_ab=True)
_SW128_DEEP = C(0, 128, 8, 6, gluon=True, swap_ab=True)
_SWAPPED_PLAIN = [
    (40, (None, _SW64, _SW128_DEEP)),
    (128, (None, _SW64, None)),
    (144, (None, _SW64, _SW128)),
    (None, (None,) * 3),
]
_SWAPPED_TREE = [
    (32, (None,) * 3),
    (64, (C(0, 64, 4, 8, gluon=True, swap_ab=True, seg_per_prog=4), None, None)),
    (128, (None,) * 3),
    (144, (C(0, 64, 4, 6, gluon=True, swap_ab=True, seg_per_prog=4), None, None)),
    (192, (C(0, 128, 8, 5, gluon=True, swap_ab=True, seg_per_prog=2), None, None)),
    (None, (None,) * 3),
]
# Plain products where a Gluon entry cannot run (not Hopper, K not a multiple of BLOCK_K, operands
# not TMA-aligned) or writes fp32 (a 128 x 256 fp32 tile does not fit beside the copy ring).
_PLAIN_NO_GLUON = [
    (128, (C(64, 64, 4, 4), C(64, 64, 4, 4), C(128, 128, 8, 3))),
    (256, (C(128, 64, 4, 4), C(64, 64, 4, 4), C(128, 256, 8, 4, tma=True))),
    (512, (C(128, 128, 4, 4), C(128, 256, 8, 4, tma=True), C(128, 256, 8, 4, tma=True))),
    (1024, (C(128, 256, 8, 4, tma=True), C(128, 128, 4, 4, tma=True), C(128, 256, 8, 4, tma=True))),
    (None, (C(128, 256, 8, 4, tma=True),) * 3),
]
# Segment tree (row-parallel layers). Small M: segment pairs spread over programs (parallelism for a
# weight-streaming product; the fp32 partials are tiny). From M = 128 on Hopper: the Gluon kernel
# (a loader warp whose copy stream never drains, tree nodes held in registers, segments that end
# mid-tile read through a segment view); where output tiles fill the last wave badly each tile's
# segments are split over 2 or 4 programs (_gluon_split), and at M <= 64 a narrow N runs one segment
# per program (_few_programs). From 145 rows the root leaves go out by TMA. Elsewhere (not Hopper, ...)
# _TREE_NO_GLUON applies.
_TREE_G64 = C(64, 128, 4, 6, gluon=True)
_TREE = [
    (16, (C(16, 64, 4, 6, seg_per_prog=2),) * 3),
    (32, (C(32, 32, 4, 4, seg_per_prog=2),) * 3),
    (64, (C(64, 32, 4, 4, seg_per_prog=2),) * 3),
    (128, (_TREE_G64,) * 3),
    (144, (C(64, 128, 4, 6, gluon=True, seg_per_prog=2),) * 3),
    (None, (C(128, 128, 8, 5, gluon=True, tma_store=True),) * 3),
]
# Without Gluon (and for 2-segment trees, where the pairs kernel is the faster one at M >= 512, or short
# segments at small M: Qwen2.5-1.5B's o, K = 1536).
_TREE_NO_GLUON = [
    (256, (C(64, 128, 4, 4, seg_per_prog=2),) * 3),
    (None, (C(128, 128, 8, 3, pairs=True, hold=False),) * 3),
]
# A plain product whose tiles would leave most SMs idle in their last wave takes the first of these
# whose tiles fill the machine at least as given (_wave_fill): a fuller wave of larger tiles beats a
# fuller one of smaller tiles only above these shares.
_SMALLER_TILES = ((_G128, 0.7), (_G64, 0.8))
# ... and at M <= 64, where a wide N in 64 x 128 tiles spills into a second wave.
_NARROWER_SMALL_M = C(64, 64, 4, 4)
_FP32_WIDE = C(128, 128, 8, 4, tma=True)  # a 128x256 fp32 epilogue needs more shared memory than there is
del C, _G64, _G64N, _G128, _G256, _R192, _R192W, _COL96, _SW64, _SW128, _SW128_DEEP


def _lookup(table, m: int, n: int) -> MMConfig:
    col = 0 if n <= 4096 else (1 if n <= 8192 else 2)
    for max_m, cfgs in table:
        if max_m is None or m <= max_m:
            return cfgs[col]
    return table[-1][1][col]


@functools.lru_cache(maxsize=4096)  # called per product: keep the dispatch off the host's critical path
def pick_config(M: int, N: int, K: int, segments: int = 1, out_dtype: torch.dtype = torch.bfloat16) -> MMConfig:
    """Launch configuration for an [M, K] x [K, N] product (a function of the shape only)."""
    cfg = _lookup(_TREE if segments > 1 else _PLAIN, M, N)
    if segments > 1 and cfg.block_m == 128 and _tiles(M, N, cfg) < current_sms() // 4:
        # too few 128-row tiles to fill a quarter of the SMs: 64-row ones, which keep more SMs busy
        # (Qwen2.5-1.5B's o, N = 1536, at M = 256)
        cfg = _TREE_G64
    if segments == 1 and M > 64 and _wave_fill(M, N, cfg) < 0.6:
        cfg = next((c for c, fill in _SMALLER_TILES if _wave_fill(M, N, c) >= fill), cfg)
    if (segments == 1 and 32 < M <= 64 and _wave_fill(M, N, cfg) < 0.6
            and _wave_fill(M, N, _NARROWER_SMALL_M) > _wave_fill(M, N, cfg)):
        cfg = _NARROWER_SMALL_M
    if cfg.gluon and (segments == 2 or not _gluon_segments(K, segments)
                      or (segments == 1 and out_dtype != torch.bfloat16)):
        cfg = _lookup(_TREE_NO_GLUON if segments > 1 else _PLAIN_NO_GLUON, M, N)
    if cfg.gluon and not cfg.seg_per_prog:
        cfg = dataclasses.replace(cfg, seg_per_prog=segments // _gluon_split(M, N, cfg, segments))
    if segments > 1 and not cfg.gluon and M <= 64 and cfg.seg_per_prog > 1 and _few_programs(M, N, cfg, segments):
        cfg = dataclasses.replace(cfg, seg_per_prog=1)  # a narrow N (Qwen2.5-1.5B's 1,536): one segment each
    if out_dtype == torch.float32 and cfg.tma and cfg.block_n > 128:
        cfg = _FP32_WIDE
    return _swapped_config(M, N, K, segments, out_dtype) or cfg


def _swapped_config(M: int, N: int, K: int, segments: int, out_dtype: torch.dtype) -> MMConfig | None:
    """The swapped table's entry for this shape, where it has one that the Gluon kernel can run (bf16 out,
    segments other than 2 that it supports) and whose work items fill the SMs' waves well enough."""
    cfg = _lookup(_SWAPPED_TREE if segments > 1 else _SWAPPED_PLAIN, M, N)
    if cfg is None or out_dtype != torch.bfloat16 or segments == 2 or not _gluon_segments(K, segments):
        return None
    split = segments // min(cfg.seg_per_prog or segments, segments)
    return cfg if _wave_fill(M, N, cfg, split) >= _SWAPPED_MIN_FILL else None


def _tiles(M: int, N: int, cfg: MMConfig) -> int:
    rows = sum(token_chunks(M)) if cfg.swap_ab else cfg.block_m * cfg.row_chunks
    return triton.cdiv(M, rows) * triton.cdiv(N, cfg.block_n)


def _wave_fill(M: int, N: int, cfg: MMConfig, split: int = 1) -> float:
    """Share of the SM slots that the work items keep busy over their waves (1.0: the last wave is full)."""
    return wave_fill(_tiles(M, N, cfg) * split, current_sms())


def _few_programs(M: int, N: int, cfg: MMConfig, segments: int) -> bool:
    """Fewer than 1.5 programs per SM with cfg's segments per program (weight streaming at small M
    wants more programs in flight)."""
    sms = current_sms()
    return _tiles(M, N, cfg) * (segments // cfg.seg_per_prog) < 1.5 * sms


def _gluon_split(M: int, N: int, cfg: MMConfig, segments: int) -> int:
    """Programs per output tile (1, 2 or 4): more only where it fills the last wave of SMs much better
    (each split costs an fp32 partial round trip). E.g. 160 tiles on 132 SMs: 61% -> 81% -> 97%."""
    split = 1
    while split < min(4, segments) and _wave_fill(M, N, cfg, split * 2) > _wave_fill(M, N, cfg, split) + 0.12:
        split *= 2
    return split


def _tma_ok(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x2.stride(1) == 1 and weight.stride(1) == 1 and x2.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0 and (x2.stride(0) * 2) % 16 == 0 and (weight.stride(0) * 2) % 16 == 0)


@functools.lru_cache(maxsize=None)
def _sm90():
    """The Gluon kernel module (matmul_sm90), or None where this Triton has no Gluon."""
    try:
        from . import matmul_sm90
    except ImportError:
        return None
    return matmul_sm90


def _gluon_segments(K: int, segments: int) -> bool:
    """Whether this Triton has the Gluon kernels and they reduce K in `segments`."""
    sm90 = _sm90()
    return sm90 is not None and sm90.segments_supported(K, segments)


def _launch_gluon(sm90, x2, weight, bias, out, segments: int, cfg: MMConfig, split: int):
    """cfg's Gluon kernel (matmul_sm90: plain tiles, swapped or column chunks) into out ([M, N], or
    [split, M, N] subtrees)."""
    if cfg.swap_ab:
        return sm90.launch_swapped(x2, weight, bias, out, segments, token_chunks(x2.shape[0]), cfg.block_n,
                                   cfg.warps, cfg.stages, cfg.group_m, split)
    if cfg.weight_chunks:
        return sm90.launch_column_chunks(x2, weight, bias, out, segments, cfg.block_m, cfg.weight_chunks, cfg.warps,
                                         cfg.stages, cfg.group_m, split)
    return sm90.launch(x2, weight, bias, out, segments, cfg.block_m, cfg.block_n, cfg.warps, cfg.stages,
                       cfg.group_m, split, tma_store=cfg.tma_store, row_chunks=cfg.row_chunks)


def _launch(x2, weight, bias, out, segments: int, cfg: MMConfig, partial: bool = False):
    """Fill out ([M, N], or [segments, M, N] fp32 partials when partial=True)."""
    if cfg.gluon:
        sm90 = _sm90() if not partial else None
        if (sm90 is not None and sm90.supported(x2, weight, segments)
                and (cfg.row_chunks == 1 or (segments == 1 and cfg.tma_store and sm90.tma_aligned(out)))):
            split = segments // min(cfg.seg_per_prog or segments, segments)  # work items per output tile
            if split == 1:
                return _launch_gluon(sm90, x2, weight, bias, out, segments, cfg, 1)
            parts = torch.empty(split, x2.shape[0], weight.shape[0], dtype=torch.float32, device=out.device)
            _combine(_launch_gluon(sm90, x2, weight, None, parts, segments, cfg, split), bias, out)
            return out
        # not Hopper, or operands not TMA-aligned
        cfg = _lookup(_TREE_NO_GLUON if segments > 1 else _PLAIN_NO_GLUON, x2.shape[0], weight.shape[0])
    M, K = x2.shape
    N = weight.shape[0]
    seg_len = triton.cdiv(K, segments)
    nseg = 1 if partial else min(cfg.seg_per_prog or segments, segments, 8)
    groups = segments // nseg
    has_bias = bias is not None and not partial
    tma_ok = _tma_ok(x2, weight) and (segments == 1 or seg_len % BLOCK_K == 0)
    # segments that end mid-tile (e.g. K = 8960 in 8 segments): 3-D descriptors zero-fill the tail
    seg3d = (not tma_ok and segments > 1 and _tma_ok(x2, weight) and K == segments * seg_len
             and (seg_len * 2) % 16 == 0)
    if cfg.pairs and (tma_ok or seg3d) and not partial and segments in (2, 4, 8):
        from triton.tools.tensor_descriptor import TensorDescriptor

        def desc(t, rows, block_rows):
            if seg3d:
                return TensorDescriptor(t, [segments, rows, seg_len], [seg_len, t.stride(0), 1],
                                        [1, block_rows, BLOCK_K])
            return TensorDescriptor(t, [rows, K], [t.stride(0), 1], [block_rows, BLOCK_K])
        x_desc, w_desc = desc(x2, M, cfg.block_m), desc(weight, N, cfg.block_n)
        tiles = _tiles(M, N, cfg)
        progs = min(tiles, num_sms(out.device.index or 0) * cfg.ctas_per_sm)
        scratch = torch.empty(progs * 2 * cfg.block_m * cfg.block_n, dtype=torch.float32, device=out.device)
        _mm_pairs_kernel[(progs,)](
            x_desc, w_desc, bias if has_bias else out, out, scratch, M, N, K, seg_len, out.stride(0), out.stride(1),
            NSEG=segments, HOLD=cfg.hold, HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m, NUM_PROGS=progs, SEG3D=seg3d, num_warps=cfg.warps,
            num_stages=cfg.stages)
        return out
    if cfg.tma and tma_ok:
        from triton.tools.tensor_descriptor import TensorDescriptor
        x_desc = TensorDescriptor(x2, [M, K], [x2.stride(0), 1], [cfg.block_m, BLOCK_K])
        w_desc = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [cfg.block_n, BLOCK_K])
        items = _tiles(M, N, cfg) * groups
        progs = min(items, num_sms(out.device.index or 0) * cfg.ctas_per_sm)
        target = out if partial or groups == 1 else torch.empty(groups, M, N, dtype=torch.float32,
                                                                  device=out.device)
        log_nseg = nseg.bit_length() - 1
        scratch = (torch.empty(progs * log_nseg * cfg.block_m * cfg.block_n, dtype=torch.float32,
                               device=out.device) if nseg >= 4 else target)
        _mm_tma_kernel[(progs,)](
            x_desc, w_desc, bias if has_bias else target, target, scratch, M, N, K, seg_len, groups,
            target.stride(0) if target.dim() == 3 else 0, target.stride(-2), target.stride(-1),
            NSEG=nseg, LOG_NSEG=log_nseg, PARTIAL=partial or groups > 1, HAS_BIAS=has_bias,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m, NUM_PROGS=progs,
            FLATTEN=cfg.flatten, num_warps=cfg.warps, num_stages=cfg.stages)
        if not partial and groups > 1:
            _combine(target, bias, out)
        return out
    tiles = _tiles(M, N, cfg)
    if partial:
        target = out
    elif groups == 1:
        target = out
    else:
        target = torch.empty(groups, M, N, dtype=torch.float32, device=out.device)
    scratch = (torch.empty(tiles * groups * cfg.block_m * cfg.block_n, dtype=torch.float32, device=out.device)
               if nseg == 8 else target)
    stride_og = target.stride(0) if target.dim() == 3 else 0
    _mm_kernel[(tiles, groups)](
        x2, weight, bias if has_bias else target, target, scratch, M, N, K, seg_len,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
        stride_og, target.stride(-2), target.stride(-1),
        NSEG=nseg, PARTIAL=partial or groups > 1, HAS_BIAS=has_bias, EVEN_K=seg_len % BLOCK_K == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m,
        num_warps=cfg.warps, num_stages=cfg.stages)
    if not partial and groups > 1:
        _combine(target, bias, out)
    return out


def _combine(parts: torch.Tensor, bias, out: torch.Tensor) -> None:
    groups, M, N = parts.shape
    if groups not in (2, 4, 8):  # wider trees: exact pairwise fp32 adds level by level
        while parts.shape[0] > 8:
            parts = parts[0::2] + parts[1::2]
        groups = parts.shape[0]
        if groups == 1:
            res = parts[0] if bias is None else parts[0] + bias.float()
            out.copy_(res)
            return
    block = min(1024, triton.next_power_of_2(N))
    _combine_kernel[(M, triton.cdiv(N, block))](
        parts, bias if bias is not None else parts, out, M, N, parts.stride(0), parts.stride(1), out.stride(0),
        G=groups, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def _check_segments(segments: int) -> None:
    if segments < 1 or segments & (segments - 1):
        raise ValueError(f"segments must be a power of two, got {segments}")


def matmul_with_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       segments: int = 1, out_dtype: torch.dtype = torch.bfloat16,
                       config: MMConfig | None = None) -> torch.Tensor:
    """matmul with a forced launch configuration (None = the table's); same numbers either way."""
    _check_segments(segments)
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    cfg = config or pick_config(M, N, K, segments, out_dtype)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    _launch(x2, weight, bias, out, segments, cfg)
    return out.reshape(*x.shape[:-1], N)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           segments: int = 1, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x @ weight.T (+ bias): x [..., K] bf16, weight [N, K] bf16; see the module docstring."""
    return matmul_with_config(x, weight, bias, segments, out_dtype, None)


def matmul_partials(x: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    """fp32 [segments, M, N]: segment s reduced from zero in tile order (no tree, no bias)."""
    M, K = x.shape
    N = weight.shape[0]
    cfg = pick_config(M, N, K, segments, torch.float32)
    out = torch.empty(segments, M, N, dtype=torch.float32, device=x.device)
    _launch(x, weight, None, out, segments, cfg, partial=True)
    return out
