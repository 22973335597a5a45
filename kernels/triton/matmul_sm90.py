"""Canonical matmul for Hopper (sm90), written in Gluon: a loader warp, MMA warps, tree nodes held close.
With one segment it is the plain product; with 2, 4 or 8 the row-parallel segment tree.

Same numbers as the Triton tree kernels in matmul.py (each segment reduced from zero, one 64-wide
K tile per wgmma group, in order; segment sums added by the fixed tree). What Gluon adds is control
that Triton's pipeliner does not give:

- warp specialisation: one loader warp runs the program's TMA loads as one stream over all its
  (tile, K tile) pairs, as far ahead as the ring has free slots, so neither a segment end nor a tile
  end (where the MMA warps fold the tree and store) stops the copies;
- a finished segment's accumulator is folded into the tree right away, while the next segment's
  first wgmma runs (the fold does not drain the tensor cores). Rule: at most three fp32 tiles are live
  in the MMA warps' registers (the accumulator, the finished leaf, one pending node), because a
  fourth makes ptxas spill and serialise the wgmmas. That covers a tree of 4 leaves; an 8-leaf tree
  runs as two such halves in a loop, the first half's node waiting in shared memory, and the root
  leaves through that memory by TMA. For the same reason no item's first wgmma starts before the
  previous item's last fold (an accumulator live across the item loop's back edge). The variants that
  lost are in docs/performance.md; scripts/sm90_compile_check.py shows spills and wgmma waits
  without a GPU.

swapped_matmul_kernel is the same product as wgmmas of one A tile against two B chunks, each a power
of two (tensor shapes are), on the wgmma N side, which takes any multiple of 8:
- swapped, for decode-sized batches: the weight tile is the A operand (its M side, 64 rows per
  warpgroup) and the batch's rows the B chunks (128 + 8 at M = 136, where row tiles pad to 192 or 256
  rows; each weight tile is then read by two or three programs);
- column chunks: the batch's rows are the A tile and a tile's weight rows the B chunks, e.g. 64 + 32 =
  96 output columns, a width no power-of-two tile has (Llama-3.1-8B's qkv, N = 6,144, at 209-256 rows:
  128 tiles of 128 x 96 on 132 SMs, against 96 of 128 x 128).
Each output element gets the same wgmma sums in the same order, so the same bits
(tests/gpu/test_triton_kernels.py compares them).

Segments that end mid-tile (Qwen2.5-1.5B's down: K = 8,960 in 8 segments of 1,120, 17.5 K tiles) are
read through a segment view, a 3-D descriptor [segments, rows, seg_len] whose TMA loads zero-fill each
segment's last tile, as the contract pads it (_copy_k_tile).
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..contract import TRITON
from .device import num_sms

BLOCK_K = TRITON.matmul_block_k  # the contract's K tile, as in matmul.py
_BK = gl.constexpr(BLOCK_K)  # the kernels' view of it


@gluon.constexpr_function
def _mma_layout(block_m, block_n, num_warps):
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    reps_n = triton.cdiv(num_warps, triton.cdiv(block_m, 16))
    max_n = max(block_n // reps_n, 8)
    n = 256
    while n > max_n or block_n % n != 0:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.constexpr_function
def _tile_shape(block_shape):
    """A ring slot's tile [rows, BLOCK_K] for a descriptor's block: [rows, BLOCK_K], or [1, rows, BLOCK_K]
    for a segment view (see _copy_k_tile)."""
    return list(block_shape[-2:])


@gluon.constexpr_function
def _tile_layout(layout):
    """The shared layout of _tile_shape's tile: a segment view's leading 1 adds no swizzle, so the 2-D
    tile the wgmma reads has the same bytes as the 3-D block TMA writes."""
    return gl.NVMMASharedLayout(layout.swizzle_byte_width, layout.element_bitwidth, rank=2)


@gluon.jit
def _ring(desc, slots: gl.constexpr):
    """The copy ring's buffers for desc's tiles: `slots` 2-D tiles."""
    return gl.allocate_shared_memory(desc.dtype, [slots] + _tile_shape(desc.block_type.shape),
                                     _tile_layout(desc.layout))


@gluon.jit
def _k_tiles(desc, NSEG: gl.constexpr, SPLIT: gl.constexpr):
    """(K tiles per segment, K tiles per work item). A 2-D descriptor's segments end on K tiles; a segment
    view [segments, rows, seg_len] rounds each segment up to whole tiles (the last one part zeros)."""
    if desc.layout.rank == 3:
        seg_tiles = gl.cdiv(desc.shape[2], _BK)
    else:
        seg_tiles = desc.shape[1] // _BK // NSEG
    return seg_tiles, seg_tiles * NSEG // SPLIT


@gluon.jit
def _copy_k_tile(desc, row, g, seg_tiles, bar, buf):
    """TMA copy of desc's rows from `row`, K tile g (counted over the whole K), into the ring tile buf.
    A segment view (a 3-D descriptor [segments, rows, seg_len], for segments that end mid-tile, e.g.
    Qwen2.5-1.5B's down: K = 8960 in 8 segments of 1120) takes tile g % seg_tiles of segment
    g // seg_tiles, and TMA zero-fills the columns past the segment's end: the contract's zero-padded
    last tile, as the Triton kernels' masked loads give it."""
    if desc.layout.rank == 3:
        seg = g // seg_tiles
        tma.async_copy_global_to_shared(desc, [seg, row, (g - seg * seg_tiles) * _BK], bar,
                                        buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout))
    else:
        tma.async_copy_global_to_shared(desc, [row, g * _BK], bar, buf)


@gluon.jit
def _issue_load(j, stream, seg_tiles, x_desc, w_desc, tail_desc, bars, a_bufs, b_bufs, t_bufs, STAGES: gl.constexpr,
                ROW_CHUNKS: gl.constexpr, TAIL: gl.constexpr):
    """TMA loads of this program's j-th K tile (at stream) into ring slot j % STAGES: the weight tile and
    the x tile's ROW_CHUNKS row blocks (a_bufs slots slot * ROW_CHUNKS + c); with TAIL, also the x rows
    after them in tail_desc's block (t_bufs, the swapped kernel's second token chunk)."""
    _, kt, off_m, off_n, k0 = stream
    slot = j % STAGES
    bar = bars.index(slot)
    rows: gl.constexpr = _tile_shape(x_desc.block_type.shape)[0]
    nbytes: gl.constexpr = ROW_CHUNKS * x_desc.block_type.nbytes + w_desc.block_type.nbytes
    if TAIL:
        mbarrier.expect(bar, nbytes + tail_desc.block_type.nbytes)
        _copy_k_tile(tail_desc, off_m + ROW_CHUNKS * rows, k0 + kt, seg_tiles, bar, t_bufs.index(slot))
    else:
        mbarrier.expect(bar, nbytes)
    for c in gl.static_range(ROW_CHUNKS):
        _copy_k_tile(x_desc, off_m + c * rows, k0 + kt, seg_tiles, bar, a_bufs.index(slot * ROW_CHUNKS + c))
    _copy_k_tile(w_desc, off_n, k0 + kt, seg_tiles, bar, b_bufs.index(slot))


@gluon.jit
def _item_coords(item, num_tiles, num_pid_m, num_pid_n, kt_per_item, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(row, column, first K tile) of a work item: output tile item % num_tiles, K part item // num_tiles.
    Tiles go in grouped order (as _tile_ids in matmul.py) for weight reuse in L2."""
    tile = item % num_tiles
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    gsize = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % gsize
    pid_n = (tile % width) // gsize
    return pid_m * BLOCK_M, pid_n * BLOCK_N, (item // num_tiles) * kt_per_item


@gluon.jit
def _advance(stream, kt_per_item, pid, num_progs, num_tiles, num_pid_m, num_pid_n, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """The load stream's next position (item index, K tile, row, column, first K tile); divisions only
    when it crosses into the next item."""
    t, kt, off_m, off_n, k0 = stream
    kt += 1
    if kt == kt_per_item:
        kt = 0
        t += 1
        off_m, off_n, k0 = _item_coords(pid + t * num_progs, num_tiles, num_pid_m, num_pid_n, kt_per_item,
                                        BLOCK_M, BLOCK_N, GROUP_M)
    return t, kt, off_m, off_n, k0


@gluon.jit
def _load_partition(x_desc, w_desc, tail_desc, ready, empty, a_bufs, b_bufs, t_bufs, pid, num_progs, total,
                    seg_tiles, kt_per_item, num_tiles, num_pid_m, num_pid_n, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, ROW_CHUNKS: gl.constexpr,
                    TAIL: gl.constexpr):
    """Loader warp: the program's whole copy stream, as far ahead as the ring has free slots (a slot is
    free once the MMA that read it has finished: `empty`). BLOCK_M: the tile's rows (all its chunks)."""
    off_m, off_n, k0 = _item_coords(pid, num_tiles, num_pid_m, num_pid_n, kt_per_item, BLOCK_M, BLOCK_N, GROUP_M)
    stream = (0, 0, off_m, off_n, k0)
    for j in range(total):
        mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        _issue_load(j, stream, seg_tiles, x_desc, w_desc, tail_desc, ready, a_bufs, b_bufs, t_bufs, STAGES,
                    ROW_CHUNKS, TAIL)
        stream = _advance(stream, kt_per_item, pid, num_progs, num_tiles, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N,
                          GROUP_M)


@gluon.constexpr_function
def _continues(s, local):
    """Whether segment s + 1 of the same item exists (its first wgmma then starts before s is folded)."""
    return 0 <= s < local - 1


@gluon.jit
def _issue(acc, cons, ready, a_bufs, b_bufs, use_acc, STAGES: gl.constexpr):
    """Start the wgmma of the program's K tile number cons (async) once its ring slot is loaded."""
    slot = cons % STAGES
    mbarrier.wait(ready.index(slot), (cons // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=use_acc, is_async=True)


@gluon.jit
def _start(cons, ready, a_bufs, b_bufs, layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
           STAGES: gl.constexpr):
    """_issue for a segment's first K tile: a fresh accumulator (the zeros are made here, where they
    are used: made once before the loops, they would hold a tile's worth of registers throughout)."""
    zeros = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    return _issue(zeros, cons, ready, a_bufs, b_bufs, False, STAGES)


@gluon.jit
def _release(empty, cons, STAGES: gl.constexpr, pred=True):
    """K tile cons - 1's wgmma has finished: its ring slot goes back to the loader."""
    mbarrier.arrive(empty.index((cons + STAGES - 1) % STAGES), pred=pred)


@gluon.jit
def _reduce_leaves(acc, cons, ready, empty, a_bufs, b_bufs, seg_tiles, layout: gl.constexpr, LEAVES: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """LEAVES (1, 2 or 4) consecutive segment sums, each reduced from zero over its K tiles in order (one
    async wgmma group in flight), folded into their tree ((s0 + s1) + (s2 + s3)) as they finish. The next
    segment's first wgmma starts before a finished segment is folded, so the tensor cores work through the
    fold. The pending nodes stay in registers (at most three tiles live). Returns (acc, cons, root)."""
    for s in gl.static_range(LEAVES):
        # segment s's first wgmma was started before segment s - 1's fold, except for the first
        for kk in range(1 if _continues(s - 1, LEAVES) else 0, seg_tiles):
            acc = _issue(acc, cons, ready, a_bufs, b_bufs, kk > 0, STAGES)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            _release(empty, cons, STAGES, kk > 0)
            cons += 1
        if _continues(s, LEAVES):
            nxt = _start(cons, ready, a_bufs, b_bufs, layout, BLOCK_M, BLOCK_N, STAGES)
            acc, nxt = warpgroup_mma_wait(1, deps=(acc, nxt))
            _release(empty, cons, STAGES)
            cons += 1
        else:
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            _release(empty, cons, STAGES)
        if s % 2 == 0:  # s is static: straight-line code
            v0 = acc
            root = acc
        else:
            l1 = v0 + acc
            root = l1
            if s == 1:
                n1 = l1
            else:
                root = n1 + l1
        if _continues(s, LEAVES):
            acc = nxt
    return acc, cons, root


@gluon.jit
def _store_root(root, bias_ptr, out_ptr, out_desc, out_smem, M, N, stride_og, stride_om, part, off_m, off_n, rows, cols,
                SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr):
    """The item's epilogue. SPLIT = 1: out tile = root (+ bias), cast; with TMA_STORE through out_smem and
    the copy engine, which clips the tile at M and N (it waits only for the previous tile's copy, so the
    store overlaps the next tile's wgmmas). SPLIT > 1: the fp32 subtree into out[part]."""
    offs_m = off_m + rows
    offs_n = off_n + cols
    if SPLIT == 1:
        if HAS_BIAS:
            root = root + gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[None, :]
        if TMA_STORE:
            tma.store_wait(0)
            out_smem.store(root.to(out_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_smem)
        else:
            mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            o_ptrs = out_ptr + offs_m.to(gl.int64)[:, None] * stride_om + offs_n[None, :]
            gl.store(o_ptrs, root.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        o_ptrs = out_ptr + offs_m.to(gl.int64)[:, None] * stride_om + offs_n[None, :]
        gl.store(o_ptrs + part.to(gl.int64) * stride_og, root, mask=mask)


@gluon.jit
def _mma_partition(bias_ptr, out_ptr, out_desc, c_smem, M, N, stride_og, stride_om, ready, empty, a_bufs, b_bufs,
                   pid, num_progs, my_items, kt_per_item, num_tiles, num_pid_m, num_pid_n, NSEG: gl.constexpr,
                   SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """MMA warps: each work item's segments reduced and folded into the tree (_reduce_leaves), then stored.
    An 8-leaf item runs as two halves of 4 leaves in a loop: the first half's node waits in shared
    memory and the second half adds it, as the tree does. (Unrolled, the 8 leaves need a fourth tile of
    registers at times, which ptxas answers with spills and serialised wgmmas.) The root then leaves
    through that shared memory by TMA, and the next item's first half waits for the copy before
    reusing it."""
    LOCAL: gl.constexpr = NSEG // SPLIT  # segments per item
    seg_tiles = kt_per_item // LOCAL
    layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, gl.num_warps())
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    cons = 0
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    if LOCAL == 8:
        # padded rows: the MMA layout's 8-row stores would otherwise hit the same banks
        node_smem = gl.allocate_shared_memory(
            gl.float32, [BLOCK_M, BLOCK_N], gl.PaddedSharedLayout.with_identity_for([[BLOCK_N, 4]], [BLOCK_M, BLOCK_N],
                                                                                    [1, 0]))
        out_smem = c_smem
        if TMA_STORE:  # no room for a buffer of its own beside the ring
            out_smem = node_smem._reinterpret(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        for t in range(my_items):
            item = pid + t * num_progs
            off_m, off_n, _k0 = _item_coords(item, num_tiles, num_pid_m, num_pid_n, kt_per_item, BLOCK_M, BLOCK_N,
                                             GROUP_M)
            for half in range(2):
                acc, cons, node = _reduce_leaves(acc, cons, ready, empty, a_bufs, b_bufs, seg_tiles, layout, 4,
                                                 BLOCK_M, BLOCK_N, STAGES)
                if half == 0:
                    if TMA_STORE:
                        tma.store_wait(0)  # the previous item's root may still be leaving from node_smem
                    node_smem.store(node)
                else:  # the epilogue in the loop: a root carried out of it would hold a tile of registers
                    _store_root(node_smem.load(layout) + node, bias_ptr, out_ptr, out_desc, out_smem, M, N, stride_og,
                                stride_om, item // num_tiles, off_m, off_n, rows, cols, SPLIT, HAS_BIAS, TMA_STORE)
    else:
        for t in range(my_items):
            item = pid + t * num_progs
            off_m, off_n, _k0 = _item_coords(item, num_tiles, num_pid_m, num_pid_n, kt_per_item, BLOCK_M, BLOCK_N,
                                             GROUP_M)
            acc, cons, root = _reduce_leaves(acc, cons, ready, empty, a_bufs, b_bufs, seg_tiles, layout, LOCAL,
                                             BLOCK_M, BLOCK_N, STAGES)
            _store_root(root, bias_ptr, out_ptr, out_desc, c_smem, M, N, stride_og, stride_om, item // num_tiles,
                        off_m, off_n, rows, cols, SPLIT, HAS_BIAS, TMA_STORE)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _mma_chunks_partition(bias_ptr, out_desc, c_smem, N, ready, empty, a_bufs, b_bufs, pid, num_progs, my_items,
                          kt_per_item, num_tiles, num_pid_m, num_pid_n, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, ROW_CHUNKS: gl.constexpr, GROUP_M: gl.constexpr,
                          STAGES: gl.constexpr):
    """MMA warps of the plain product over tiles of ROW_CHUNKS x BLOCK_M rows (e.g. 3 x 64 = 192, which a
    power-of-two tile cannot be): one accumulator per row chunk, each K tile's wgmmas (one per chunk,
    the same weight tile) issued together and retired together. Each element is still reduced over
    the K tiles in order, from zero. The epilogue stores chunk by chunk through c_smem (TMA)."""
    layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, gl.num_warps())
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    cons = 0
    for t in range(my_items):
        off_m, off_n, _k0 = _item_coords(pid + t * num_progs, num_tiles, num_pid_m, num_pid_n, kt_per_item,
                                         BLOCK_M * ROW_CHUNKS, BLOCK_N, GROUP_M)
        accs = ()
        for c in gl.static_range(ROW_CHUNKS):
            accs = accs + (gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout), )
        for kk in range(kt_per_item):
            slot = cons % STAGES
            mbarrier.wait(ready.index(slot), (cons // STAGES) & 1)
            w_tile = b_bufs.index(slot).permute((1, 0))
            issued = ()
            for c in gl.static_range(ROW_CHUNKS):
                issued = issued + (warpgroup_mma(a_bufs.index(slot * ROW_CHUNKS + c), w_tile, accs[c], use_acc=kk > 0,
                                                 is_async=True), )
            # the previous K tile's wgmmas are done: its slot goes back to the loader
            accs = warpgroup_mma_wait(ROW_CHUNKS, deps=issued)
            _release(empty, cons, STAGES, kk > 0)
            cons += 1
        accs = warpgroup_mma_wait(0, deps=accs)
        _release(empty, cons, STAGES)
        if HAS_BIAS:
            offs_n = off_n + cols
            bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[None, :]
        for c in gl.static_range(ROW_CHUNKS):
            root = accs[c]
            if HAS_BIAS:
                root = root + bias
            tma.store_wait(0)
            c_smem.store(root.to(out_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [off_m + c * BLOCK_M, off_n], c_smem)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["M"])
def tree_matmul_kernel(x_desc, w_desc, bias_ptr, out_ptr, out_desc, M, N, stride_og, stride_om,
                       NSEG: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       num_warps: gl.constexpr, ROW_CHUNKS: gl.constexpr = 1):
    """Tree over NSEG (1, 2, 4 or 8) segment sums of x @ w.T, persistent over work items.
    SPLIT = 1: an item is an output tile; out = the root (+ bias), cast (TMA_STORE: through out_desc).
    SPLIT = 2 or 4: an item is that share of a tile's segments; out[h] = its subtree in fp32 (the caller
    adds them in the tree's order: the root; more items than tiles evens out the last wave at mid-sized M).
    ROW_CHUNKS > 1 (plain products only: NSEG = SPLIT = 1, TMA_STORE): a tile is ROW_CHUNKS x BLOCK_M rows.
    num_warps MMA warps (the default partition) and one loader warp."""
    pid = gl.program_id(0)
    num_progs = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M * ROW_CHUNKS)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    my_items = gl.cdiv(num_tiles * SPLIT - pid, num_progs)
    seg_tiles, kt_per_item = _k_tiles(x_desc, NSEG, SPLIT)
    total = my_items * kt_per_item

    a_bufs = _ring(x_desc, STAGES * ROW_CHUNKS)
    b_bufs = _ring(w_desc, STAGES)
    c_smem = a_bufs  # placeholder unless the epilogue goes through a buffer of its own
    if TMA_STORE and NSEG // SPLIT != 8:
        c_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    # the MMA partition for the tile kind; the loader is the same
    if ROW_CHUNKS == 1:
        gl.warp_specialize([
            (_mma_partition, (bias_ptr, out_ptr, out_desc, c_smem, M, N, stride_og, stride_om, ready, empty,
                              a_bufs, b_bufs, pid, num_progs, my_items, kt_per_item, num_tiles, num_pid_m, num_pid_n,
                              NSEG, SPLIT, HAS_BIAS, TMA_STORE, BLOCK_M, BLOCK_N, GROUP_M, STAGES)),
            (_load_partition, (x_desc, w_desc, x_desc, ready, empty, a_bufs, b_bufs, a_bufs, pid, num_progs, total,
                               seg_tiles, kt_per_item, num_tiles, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M,
                               STAGES, 1, False)),
        ], [1], [24])
    else:
        gl.warp_specialize([
            (_mma_chunks_partition, (bias_ptr, out_desc, c_smem, N, ready, empty, a_bufs, b_bufs, pid, num_progs,
                                     my_items, kt_per_item, num_tiles, num_pid_m, num_pid_n, HAS_BIAS, BLOCK_M,
                                     BLOCK_N, ROW_CHUNKS, GROUP_M, STAGES)),
            (_load_partition, (x_desc, w_desc, x_desc, ready, empty, a_bufs, b_bufs, a_bufs, pid, num_progs, total,
                               seg_tiles, kt_per_item, num_tiles, num_pid_m, num_pid_n, BLOCK_M * ROW_CHUNKS, BLOCK_N,
                               GROUP_M, STAGES, ROW_CHUNKS, False)),
        ], [1], [24])
    _drop_ring_barriers(ready, empty, STAGES)


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """The copy ring's barriers: `ready` (slot loaded) and `empty` (slot read by its MMA) per slot."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def _drop_ring_barriers(ready, empty, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def _swapped_issue(acc, cons, ready, head_bufs, a_bufs, tail_bufs, use_acc, STAGES: gl.constexpr):
    """Start K tile cons's two wgmmas once its slot is loaded: the A tile (the wgmma M side) against the
    head and tail B chunks (its N side, any multiple of 8)."""
    slot = cons % STAGES
    mbarrier.wait(ready.index(slot), (cons // STAGES) & 1)
    a_tile = a_bufs.index(slot)
    head = warpgroup_mma(a_tile, head_bufs.index(slot).permute((1, 0)), acc[0], use_acc=use_acc, is_async=True)
    tail = warpgroup_mma(a_tile, tail_bufs.index(slot).permute((1, 0)), acc[1], use_acc=use_acc, is_async=True)
    return head, tail


@gluon.jit
def _swapped_zeros(BLOCK_A: gl.constexpr, HEAD: gl.constexpr, TAIL: gl.constexpr):
    """Fresh accumulators of the two chunks (made where used, as _start's)."""
    return (gl.zeros((BLOCK_A, HEAD), dtype=gl.float32, layout=_mma_layout(BLOCK_A, HEAD, gl.num_warps())),
            gl.zeros((BLOCK_A, TAIL), dtype=gl.float32, layout=_mma_layout(BLOCK_A, TAIL, gl.num_warps())))


@gluon.jit
def _store_chunk(chunk, bias_ptr, out_ptr, off_a, off_b, M, N, stride_om, part, HAS_BIAS: gl.constexpr,
                 X_ON_A: gl.constexpr):
    """Store a chunk [BLOCK_A, rows], A row off_a + i against B row off_b + j (+ the bias of the weight row),
    masked at M and N: into out[off_a + i, off_b + j] (X_ON_A) or out[off_b + j, off_a + i] (swapped). part:
    the element offset of this item's fp32 subtree (split tiles) or 0."""
    layout: gl.constexpr = chunk.type.layout
    offs_a = off_a + gl.arange(0, chunk.type.shape[0], layout=gl.SliceLayout(1, layout))
    offs_b = off_b + gl.arange(0, chunk.type.shape[1], layout=gl.SliceLayout(0, layout))
    if X_ON_A:
        if HAS_BIAS:
            chunk = chunk + gl.load(bias_ptr + offs_b, mask=offs_b < N, other=0.0).to(gl.float32)[None, :]
        mask = (offs_a < M)[:, None] & (offs_b < N)[None, :]
        o_ptrs = out_ptr + part + offs_a.to(gl.int64)[:, None] * stride_om + offs_b[None, :]
    else:
        if HAS_BIAS:
            chunk = chunk + gl.load(bias_ptr + offs_a, mask=offs_a < N, other=0.0).to(gl.float32)[:, None]
        mask = (offs_a < N)[:, None] & (offs_b < M)[None, :]
        o_ptrs = out_ptr + part + offs_b.to(gl.int64)[None, :] * stride_om + offs_a[:, None]
    gl.store(o_ptrs, chunk.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _mma_swapped_partition(bias_ptr, out_ptr, M, N, stride_og, stride_om, ready, empty, head_bufs, a_bufs, tail_bufs,
                           pid, num_progs, my_items, kt_per_item, num_tiles, num_pid_b, num_pid_a, NSEG: gl.constexpr,
                           SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, X_ON_A: gl.constexpr, HEAD: gl.constexpr,
                           TAIL: gl.constexpr, BLOCK_A: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """MMA warps of swapped_matmul_kernel: per work item, the output tile [BLOCK_A, HEAD + TAIL] as two
    accumulators, each segment reduced from zero over its K tiles in order and folded into the tree (up
    to 4 leaves per item: the pending nodes stay in registers), then stored (_store_chunk). As in
    _mma_partition, the next segment's first wgmmas start before a finished segment is folded."""
    LOCAL: gl.constexpr = NSEG // SPLIT  # segments per item
    gl.static_assert(LOCAL <= 4)
    seg_tiles = kt_per_item // LOCAL
    cons = 0
    acc = _swapped_zeros(BLOCK_A, HEAD, TAIL)
    for t in range(my_items):
        item = pid + t * num_progs
        off_b, off_a, _k0 = _item_coords(item, num_tiles, num_pid_b, num_pid_a, kt_per_item, HEAD + TAIL, BLOCK_A,
                                         GROUP_M)
        for s in gl.static_range(LOCAL):
            for kk in range(1 if _continues(s - 1, LOCAL) else 0, seg_tiles):
                acc = _swapped_issue(acc, cons, ready, head_bufs, a_bufs, tail_bufs, kk > 0, STAGES)
                acc = warpgroup_mma_wait(2, deps=acc)  # the previous K tile's pair is done
                _release(empty, cons, STAGES, kk > 0)
                cons += 1
            if _continues(s, LOCAL):
                nxt = _swapped_issue(_swapped_zeros(BLOCK_A, HEAD, TAIL), cons, ready, head_bufs, a_bufs, tail_bufs,
                                     False, STAGES)
                head, tail, nxt_head, nxt_tail = warpgroup_mma_wait(2, deps=(acc[0], acc[1], nxt[0], nxt[1]))
                acc = (head, tail)
                nxt = (nxt_head, nxt_tail)
                _release(empty, cons, STAGES)
                cons += 1
            else:
                acc = warpgroup_mma_wait(0, deps=acc)
                _release(empty, cons, STAGES)
            # the tree over this item's leaves ((s0 + s1) + (s2 + s3)), chunk by chunk
            if s % 2 == 0:
                v0 = acc
                root = acc
            else:
                l1 = (v0[0] + acc[0], v0[1] + acc[1])
                root = l1
                if s == 1:
                    n1 = l1
                else:
                    root = (n1[0] + l1[0], n1[1] + l1[1])
            if _continues(s, LOCAL):
                acc = nxt
        part = (item // num_tiles).to(gl.int64) * stride_og
        _store_chunk(root[0], bias_ptr, out_ptr, off_a, off_b, M, N, stride_om, part, HAS_BIAS, X_ON_A)
        _store_chunk(root[1], bias_ptr, out_ptr, off_a, off_b + HEAD, M, N, stride_om, part, HAS_BIAS, X_ON_A)


@gluon.jit(do_not_specialize=["M"])
def swapped_matmul_kernel(a_desc, head_desc, tail_desc, bias_ptr, out_ptr, M, N, stride_og, stride_om,
                          NSEG: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, X_ON_A: gl.constexpr,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """x [M, K] @ w [N, K].T as wgmmas of an A tile (a_desc's block rows, 64 per warpgroup) against a head
    and a tail B chunk (their descriptors' block rows, powers of two). X_ON_A: A = x's rows, B = w's
    (column chunks); else A = w's, B = x's (swapped: a tile covers e.g. 136 rows as 128 + 8, where 64-
    or 128-row tiles would pad to 192 or 256). Each element is reduced as in tree_matmul_kernel (the same
    bits); SPLIT as there, with at most 4 segments per item. Persistent over work items; one loader warp."""
    BLOCK_A: gl.constexpr = _tile_shape(a_desc.block_type.shape)[0]
    HEAD: gl.constexpr = _tile_shape(head_desc.block_type.shape)[0]
    TAIL: gl.constexpr = _tile_shape(tail_desc.block_type.shape)[0]
    pid = gl.program_id(0)
    num_progs = gl.num_programs(0)
    if X_ON_A:
        num_pid_a = gl.cdiv(M, BLOCK_A)
        num_pid_b = gl.cdiv(N, HEAD + TAIL)
    else:
        num_pid_a = gl.cdiv(N, BLOCK_A)
        num_pid_b = gl.cdiv(M, HEAD + TAIL)
    num_tiles = num_pid_a * num_pid_b
    my_items = gl.cdiv(num_tiles * SPLIT - pid, num_progs)
    seg_tiles, kt_per_item = _k_tiles(a_desc, NSEG, SPLIT)
    total = my_items * kt_per_item

    head_bufs = _ring(head_desc, STAGES)
    tail_bufs = _ring(tail_desc, STAGES)
    a_bufs = _ring(a_desc, STAGES)
    ready, empty = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_mma_swapped_partition, (bias_ptr, out_ptr, M, N, stride_og, stride_om, ready, empty, head_bufs, a_bufs,
                                  tail_bufs, pid, num_progs, my_items, kt_per_item, num_tiles, num_pid_b, num_pid_a,
                                  NSEG, SPLIT, HAS_BIAS, X_ON_A, HEAD, TAIL, BLOCK_A, GROUP_M, STAGES)),
        # the loader's "x" is the B side here (head and tail chunks), its "w" the A tile
        (_load_partition, (head_desc, a_desc, tail_desc, ready, empty, head_bufs, a_bufs, tail_bufs, pid, num_progs,
                           total, seg_tiles, kt_per_item, num_tiles, num_pid_b, num_pid_a, HEAD + TAIL, BLOCK_A,
                           GROUP_M, STAGES, 1, True)),
    ], [1], [24])
    _drop_ring_barriers(ready, empty, STAGES)


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def tma_aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0


def segments_supported(K: int, segments: int) -> bool:
    """Whether the kernels can reduce K in `segments` (1, 2, 4 or 8): segments that end on K tiles, or
    that end mid-tile but start on 16 bytes (a segment view's TMA strides: 8 bf16 elements)."""
    return segments in (1, 2, 4, 8) and K % segments == 0 and (K // segments) % 8 == 0


def supported(x2: torch.Tensor, weight: torch.Tensor, segments: int) -> bool:
    """Hopper, bf16, segments_supported, TMA-aligned operands."""
    return (x2.is_cuda and _is_sm90(x2.device.index or 0) and x2.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and segments_supported(x2.shape[1], segments)
            and tma_aligned(x2) and tma_aligned(weight))


@functools.lru_cache(maxsize=None)
def _shared_memory_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The NVMMA shared layout of a TMA block (computed once: it costs about a third of a launch's host
    time, and eager steps launch hundreds of products)."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _tma_desc(t: torch.Tensor, block_rows: int, block_cols: int = BLOCK_K) -> TensorDescriptor:
    """A TMA descriptor over a row-major 2-D tensor, in blocks of block_rows x block_cols (K tiles by default)."""
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [block_rows, block_cols],
                            _smem_layout((block_rows, block_cols), t.dtype))


def _operand_desc(t: torch.Tensor, block_rows: int, segments: int) -> TensorDescriptor:
    """An operand's K-tile descriptor: 2-D where the segments end on K tiles, else the segment view
    [segments, rows, seg_len] in blocks of [1, block_rows, BLOCK_K] (the kernels' _copy_k_tile)."""
    K = t.shape[1]
    if K % (segments * BLOCK_K) == 0:
        return _tma_desc(t, block_rows)
    seg_len = K // segments
    block = (1, block_rows, BLOCK_K)
    return TensorDescriptor(t, [segments, t.shape[0], seg_len], [seg_len, t.stride(0), 1], list(block),
                            _smem_layout(block, t.dtype))


def mma_maxnreg(warps: int) -> int:
    """Registers per thread for a launch of `warps` MMA warps: the launch must fit (warps + a loader
    warpgroup) x 32 threads in the register file; the loader then hands its share to the MMA warps
    (setmaxnreg)."""
    return 65536 // ((warps + 4) * 32) // 8 * 8


def swapped_stages(head: int, tail: int, block_a: int, stages: int, element_size: int, shared_bytes: int) -> int:
    """The swapped kernel's ring stages: as many as shared memory holds, up to `stages` (a 128 + 128-row
    tile needs fewer)."""
    stage_bytes = (head + tail + block_a) * BLOCK_K * element_size
    return max(2, min(stages, (shared_bytes - 4096) // stage_bytes))


def launch(x2: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor, segments: int, block_m: int,
           block_n: int, warps: int, stages: int, group_m: int = 8, split: int = 1,
           tma_store: bool = False, row_chunks: int = 1) -> torch.Tensor:
    """split = 1: fill out [M, N] with the tree product (+ bias). split = 2 or 4: fill out [split, M, N]
    (fp32) with the subtrees, for the caller to add. The caller checks `supported` first. tma_store:
    the epilogue goes through shared memory and the copy engine (split = 1, TMA-aligned out).
    row_chunks > 1: tiles of row_chunks x block_m rows (plain products stored by TMA only)."""
    M = x2.shape[0]
    N = weight.shape[0]
    x_desc, w_desc = _operand_desc(x2, block_m, segments), _operand_desc(weight, block_n, segments)
    tma_store = tma_store and split == 1 and tma_aligned(out)
    if row_chunks > 1 and not (segments == 1 and tma_store):
        raise ValueError(f"row_chunks={row_chunks} needs a plain product stored by TMA (segments={segments}, "
                         f"split={split}, TMA-aligned out: {tma_aligned(out)})")
    items = triton.cdiv(M, block_m * row_chunks) * triton.cdiv(N, block_n) * split
    progs = min(items, num_sms(out.device.index or 0))
    out_desc = x_desc  # placeholder
    if tma_store:
        out_desc = _tma_desc(out, block_m, block_n)
    tree_matmul_kernel[(progs,)](
        x_desc, w_desc, bias if bias is not None else out, out, out_desc, M, N,
        out.stride(0) if split > 1 else 0, out.stride(-2), NSEG=segments, SPLIT=split,
        HAS_BIAS=bias is not None and split == 1, TMA_STORE=tma_store, BLOCK_M=block_m, BLOCK_N=block_n,
        GROUP_M=group_m, STAGES=stages, num_warps=warps, ROW_CHUNKS=row_chunks, maxnreg=mma_maxnreg(warps))
    return out


def launch_swapped(x2: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor, segments: int,
                   token_chunks: tuple[int, int], block_n: int, warps: int, stages: int, group_m: int = 8,
                   split: int = 1) -> torch.Tensor:
    """As `launch`, with swapped_matmul_kernel: tiles of block_n weight rows (64 per 4 warps) by
    token_chunks = (head, tail) rows of x (powers of two, see matmul.token_chunks)."""
    return _launch_two_chunks(x2, weight, bias, out, segments, weight, block_n, token_chunks, False, warps, stages,
                              group_m, split)


def launch_column_chunks(x2: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor, segments: int,
                         block_m: int, weight_chunks: tuple[int, int], warps: int, stages: int, group_m: int = 8,
                         split: int = 1) -> torch.Tensor:
    """As `launch`, with swapped_matmul_kernel's column chunks: tiles of block_m rows of x (64 per 4 warps)
    by weight_chunks = (head, tail) weight rows (powers of two, e.g. 64 + 32 = 96 output columns)."""
    return _launch_two_chunks(x2, weight, bias, out, segments, x2, block_m, weight_chunks, True, warps, stages,
                              group_m, split)


def _launch_two_chunks(x2, weight, bias, out, segments: int, a: torch.Tensor, block_a: int, chunks: tuple[int, int],
                       x_on_a: bool, warps: int, stages: int, group_m: int, split: int) -> torch.Tensor:
    """swapped_matmul_kernel with `a` (x2 or weight) in A tiles of block_a rows and the other operand in
    B tiles of chunks = (head, tail) rows."""
    M = x2.shape[0]
    N = weight.shape[0]
    head, tail = chunks
    if segments // split > 4:
        raise ValueError(f"the swapped kernel reduces at most 4 segments per work item (segments={segments}, "
                         f"split={split})")
    b = weight if x_on_a else x2
    device = out.device.index or 0
    stages = swapped_stages(head, tail, block_a, stages, x2.element_size(), _shared_memory_bytes(device))
    items = triton.cdiv(a.shape[0], block_a) * triton.cdiv(b.shape[0], head + tail) * split
    progs = min(items, num_sms(device))
    a_desc, head_desc, tail_desc = (_operand_desc(t, rows, segments)
                                    for t, rows in ((a, block_a), (b, head), (b, tail)))
    swapped_matmul_kernel[(progs,)](
        a_desc, head_desc, tail_desc, bias if bias is not None else out, out, M, N,
        out.stride(0) if split > 1 else 0, out.stride(-2), NSEG=segments, SPLIT=split,
        HAS_BIAS=bias is not None and split == 1, X_ON_A=x_on_a, GROUP_M=group_m, STAGES=stages, num_warps=warps,
        maxnreg=mma_maxnreg(warps))
    return out
