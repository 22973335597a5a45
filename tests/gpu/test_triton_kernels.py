"""GPU: the Triton canonical kernels are batch-, position-, chunking- and layout-invariant, bit for bit.

Run with `pytest -m gpu` on a machine with CUDA and triton. Bitwise comparisons go through integer
views, so -0.0 vs +0.0 and NaN payloads count as differences.
(Development only: TRITON_INTERPRET=1 runs the small cases on CPU through the Triton interpreter.)
"""
from __future__ import annotations

import importlib
import math
import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

from triton_shared import DEV, INTERPRET, kt, needs_cuda  # noqa: F401,E402 (kt: a fixture)

BF = torch.bfloat16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, dtype=BF, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed), device=DEV, dtype=torch.float32) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------- matmul

SMALL_BATCHES = list(range(1, 65))
BIG_BATCHES = [96, 128, 200, 256, 384, 512, 1024, 2048]


def _row_invariance(kt, k_dim, n_dim, segments, out_dtype, bias, batches, m_full):
    x = randn(m_full, k_dim, seed=1)
    w = randn(n_dim, k_dim, seed=2, scale=0.02)
    b = randn(n_dim, seed=3) if bias else None
    full = kt.matmul(x, w, b, segments=segments, out_dtype=out_dtype)
    rng = random.Random(k_dim + n_dim + segments)
    for m in batches:
        if m > m_full:
            continue
        off = rng.randrange(0, m_full - m + 1)
        part = kt.matmul(x[off:off + m], w, b, segments=segments, out_dtype=out_dtype)
        assert same_bits(part, full[off:off + m]), f"M={m} offset={off} differs from the same rows in M={m_full}"


@pytest.mark.parametrize("k_dim,n_dim,segments,out_dtype,bias", [
    (512, 384, 1, BF, False),
    (512, 384, 8, BF, True),
    (320, 200, 2, torch.float32, True),  # ragged N and K tails
])
def test_matmul_row_invariance_small(kt, k_dim, n_dim, segments, out_dtype, bias):
    batches = [1, 2, 3, 5, 8, 17, 33, 64] if INTERPRET else SMALL_BATCHES + BIG_BATCHES
    _row_invariance(kt, k_dim, n_dim, segments, out_dtype, bias, batches, 80 if INTERPRET else 2048)


@needs_cuda
@pytest.mark.parametrize("name,k_dim,n_dim,segments", [
    ("qkv", 4096, 6144, 1), ("o", 4096, 4096, 8), ("gate_up", 4096, 28672, 1), ("down", 14336, 4096, 8),
    ("down_plain", 14336, 4096, 1), ("qwen_down", 8960, 1536, 8),  # Qwen2.5-1.5B: segments end mid-tile
    ("qwen_gate_up", 1536, 17920, 1), ("qwen_o", 1536, 1536, 8),  # its wave-fill entries of the table
])
def test_matmul_row_invariance_llama(kt, name, k_dim, n_dim, segments):
    """Rows of M = 1..64 and larger batches (every entry of the launch table) equal rows of M = 4096."""
    _row_invariance(kt, k_dim, n_dim, segments, BF, False, SMALL_BATCHES + BIG_BATCHES + [4096], 4096)


@needs_cuda
def test_lm_head_logits_row_invariance(kt):
    x = randn(512, 4096, seed=4)
    w = randn(128256, 4096, seed=5, scale=0.02)
    full = kt.matmul(x, w, out_dtype=torch.float32)
    for m, off in [(1, 0), (1, 311), (7, 100), (64, 17), (300, 200)]:
        assert same_bits(kt.matmul(x[off:off + m], w, out_dtype=torch.float32), full[off:off + m])


def _configs(kt):
    C = kt.MMConfig
    out = [C(16, 32, 4, 3), C(32, 64, 4, 4), C(64, 64, 4, 4), C(64, 128, 4, 3), C(128, 128, 8, 3),
           C(128, 256, 8, 3), C(128, 64, 4, 4, group_m=1)]
    if not INTERPRET:
        out += [C(128, 256, 8, 3, tma=True), C(128, 128, 4, 4, tma=True), C(64, 128, 4, 4, tma=True)]
    return out


def _gluon_plain_configs(kt):
    """The Gluon kernel with one segment (Hopper; its fallback elsewhere), TMA-store and pointer epilogues."""
    C = kt.MMConfig
    return [C(128, 256, 8, 3, gluon=True, tma_store=True, group_m=16), C(64, 128, 4, 6, gluon=True, tma_store=True),
            C(128, 128, 4, 5, gluon=True), C(128, 128, 8, 4, gluon=True, tma_store=True),
            # 192-row tiles of three 64-row chunks (at M = 300 the second tile's last chunk is all padding)
            C(64, 64, 4, 6, gluon=True, tma_store=True, row_chunks=3),
            C(64, 256, 8, 3, gluon=True, tma_store=True, row_chunks=3)]


@pytest.mark.parametrize("segments,k_dim", [(1, 4096), (8, 4096), (8, 8960)])
def test_matmul_tile_configs_bitwise_identical(kt, segments, k_dim):
    """Tile shape, warps, stages, TMA/persistence and how the segment tree is split over programs
    do not change a single bit (if a Triton or driver upgrade breaks this, the canonical order is gone).
    K = 8960 in 8 segments ends each segment mid-tile (masked loads vs TMA zero-fill)."""
    m, k_dim, n_dim = (40, 512, 192) if INTERPRET else (300, k_dim, 6144)
    x = randn(m, k_dim, seed=6)
    w = randn(n_dim, k_dim, seed=7, scale=0.02)
    b = randn(n_dim, seed=8)
    base = kt.matmul_with_config(x, w, b, segments, BF, kt.MMConfig(64, 64, 4, 2))
    variants = _configs(kt)
    if segments == 1 and not INTERPRET:
        variants += _gluon_plain_configs(kt)
    if segments > 1:  # every split of the tree over programs, each on a different tile shape
        variants = [kt.MMConfig(c.block_m, c.block_n, c.warps, c.stages, seg_per_prog=(1, 2, 4, 8)[i % 4],
                                group_m=c.group_m) for i, c in enumerate(variants) if not c.tma]
        variants += [kt.MMConfig(64, 64, 4, 2, seg_per_prog=s) for s in (1, 2, 4, 8)]
        variants += [kt.MMConfig(128, 128, 8, 4, seg_per_prog=8, tma=True),
                     kt.MMConfig(64, 128, 4, 4, seg_per_prog=4, tma=True, ctas_per_sm=2),
                     kt.MMConfig(128, 128, 8, 3, seg_per_prog=2, tma=True, flatten=False),
                     kt.MMConfig(128, 64, 4, 4, seg_per_prog=1, tma=True),
                     kt.MMConfig(16, 64, 4, 3, seg_per_prog=8, tma=True),
                     kt.MMConfig(128, 128, 8, 3, pairs=True),
                     kt.MMConfig(64, 128, 4, 2, pairs=True, hold=False, ctas_per_sm=2),
                     kt.MMConfig(16, 64, 4, 3, pairs=True)]
        if not INTERPRET:  # the Hopper Gluon kernel (elsewhere, and for K = 8960, its pairs fallback)
            variants += [kt.MMConfig(128, 128, 8, 4, gluon=True), kt.MMConfig(128, 64, 4, 5, gluon=True),
                         kt.MMConfig(64, 128, 4, 6, gluon=True, group_m=1),
                         # the root stored by TMA through the node buffer of the 8-leaf tree's first half
                         kt.MMConfig(128, 128, 8, 5, gluon=True, tma_store=True),
                         kt.MMConfig(64, 128, 4, 6, gluon=True, tma_store=True, group_m=1),
                         kt.MMConfig(128, 128, 8, 5, gluon=True, seg_per_prog=4),  # tiles split in halves
                         kt.MMConfig(64, 128, 4, 6, gluon=True, seg_per_prog=2)]  # ... and in quarters
            variants += _swapped_configs(kt, tree=True)
    elif not INTERPRET:
        variants += _swapped_configs(kt, tree=False)
    for v in variants:
        out = kt.matmul_with_config(x, w, b, segments, BF, v)
        assert same_bits(out, base), f"config {v} differs"


def _table_configs(tree: bool):
    """Every launch configuration matmul.py's dispatch can pick for plain products or segment trees."""
    mm = importlib.import_module("kernels.triton.matmul")
    tables = (mm._TREE, mm._TREE_NO_GLUON) if tree else (mm._PLAIN, mm._PLAIN_NO_GLUON)
    cfgs = {c for table in tables for _, row in table for c in row}
    cfgs |= {mm._TREE_G64} if tree else {c for c, _ in mm._SMALLER_TILES} | {mm._NARROWER_SMALL_M, mm._FP32_WIDE}
    cfgs |= {c for _, row in (mm._SWAPPED_TREE if tree else mm._SWAPPED_PLAIN) for c in row if c is not None}
    return sorted(cfgs, key=repr)


@needs_cuda
@pytest.mark.parametrize("segments", [1, 8])
def test_launch_table_configs_bitwise_identical(kt, segments):
    """Each configuration the tables hold gives the same bits as a plain 64 x 64 launch, whatever it
    is picked for, at a decode-sized and a prefill-sized M (a table entry added untested fails here)."""
    w = randn(6144, 4096, seed=7, scale=0.02)
    b = randn(6144, seed=8)
    for m in (200, 1100):
        x = randn(m, 4096, seed=6)
        base = kt.matmul_with_config(x, w, b, segments, BF, kt.MMConfig(64, 64, 4, 2))
        for cfg in _table_configs(tree=segments > 1):
            out = kt.matmul_with_config(x, w, b, segments, BF, cfg)
            assert same_bits(out, base), f"M={m}: config {cfg} differs"


@needs_cuda
@pytest.mark.parametrize("m", [136, 168, 192, 200])
def test_matmul_row_chunk_tiles_bitwise_identical(kt, m):
    """Tiles of three or four 64-row accumulators (192 or 256 rows, one wgmma each per K tile) give a
    64 x 64 launch's bits at decode-sized M, with and without bias; on Hopper they are the Gluon kernel's."""
    C = kt.MMConfig
    x, w, b = randn(m, 4096, seed=13), randn(6144, 4096, seed=14, scale=0.02), randn(6144, seed=15)
    if torch.cuda.get_device_capability()[0] == 9:
        assert importlib.import_module("kernels.triton.matmul")._sm90().supported(x, w, 1)
    for bias in (None, b):
        base = kt.matmul_with_config(x, w, bias, 1, BF, C(64, 64, 4, 2))
        for cfg in (C(64, 64, 4, 6, gluon=True, tma_store=True, row_chunks=3),
                    C(64, 128, 4, 4, gluon=True, tma_store=True, row_chunks=3),
                    C(64, 256, 8, 3, gluon=True, tma_store=True, row_chunks=3, group_m=1),
                    C(64, 64, 4, 5, gluon=True, tma_store=True, row_chunks=4),
                    C(64, 128, 8, 4, gluon=True, tma_store=True, row_chunks=4)):
            out = kt.matmul_with_config(x, w, bias, 1, BF, cfg)
            assert same_bits(out, base), f"M={m}, bias={bias is not None}: config {cfg} differs"


def _swapped_configs(kt, tree: bool):
    """Swapped launches (weights on the wgmma M side, x's rows on its N side), with 4 and 8 MMA warps,
    and column chunks (x's rows on the M side, a tile's weight rows on the N side as two chunks: 96, 192
    and 160 columns, the last not dividing N = 6,144); trees split over 2, 4 and 8 programs per output
    tile (2 to 4 segments per program)."""
    C = kt.MMConfig
    if not tree:
        return [C(0, 128, 8, 5, gluon=True, swap_ab=True), C(0, 64, 4, 6, gluon=True, swap_ab=True, group_m=1),
                C(0, 128, 4, 4, gluon=True, swap_ab=True), C(128, 96, 4, 6, gluon=True, weight_chunks=(64, 32)),
                C(64, 192, 8, 4, gluon=True, weight_chunks=(128, 64), group_m=1),
                C(128, 160, 8, 4, gluon=True, weight_chunks=(128, 32))]
    return [C(0, 128, 8, 5, gluon=True, swap_ab=True, seg_per_prog=4),
            C(0, 128, 8, 5, gluon=True, swap_ab=True, seg_per_prog=2),
            C(0, 64, 4, 6, gluon=True, swap_ab=True, seg_per_prog=2, group_m=1),
            C(128, 96, 8, 5, gluon=True, weight_chunks=(64, 32), seg_per_prog=4),
            C(64, 96, 4, 6, gluon=True, weight_chunks=(64, 32), seg_per_prog=2, group_m=1)]


@needs_cuda
@pytest.mark.parametrize("segments", [1, 4, 8])
@pytest.mark.parametrize("m", [8, 40, 72, 104, 128, 136, 168, 256])
def test_matmul_swapped_tiles_bitwise_identical(kt, m, segments):
    """The swapped kernel (a tile of 128 + 8 rows at M = 136, 64 + 64 at 128, ...; or 64 + 32 weight rows
    against x's rows) gives a 64 x 64 launch's bits, plain and as the 4- and 8-leaf trees (a TP = 2
    rank's and TP = 1's), with and without bias, as does the launch the tables pick; the same launch with
    a different tree does not, so the comparison sees the reduction order."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the swapped kernel is Gluon, for sm90")
    C = kt.MMConfig
    x, w, b = randn(m, 4096, seed=16), randn(6144, 4096, seed=17, scale=0.02), randn(6144, seed=18)
    assert importlib.import_module("kernels.triton.matmul")._sm90().supported(x, w, segments)
    for bias in (None, b):
        base = kt.matmul_with_config(x, w, bias, segments, BF, C(64, 64, 4, 2))
        for cfg in _swapped_configs(kt, tree=segments > 1):
            out = kt.matmul_with_config(x, w, bias, segments, BF, cfg)
            assert same_bits(out, base), f"M={m}, bias={bias is not None}: config {cfg} differs"
        # the launch the tables pick (at 256 rows for the plain product: 128 x 96 column chunks)
        assert same_bits(kt.matmul(x, w, bias, segments, BF), base), f"M={m}: the table's launch differs"
        other = {1: 2, 4: 8, 8: 4}[segments]
        control = kt.matmul_with_config(x, w, bias, other, BF, C(0, 128, 8, 5, gluon=True, swap_ab=True,
                                                                seg_per_prog=2))
        assert not same_bits(control, base), f"M={m}: a {other}-leaf tree gave the {segments}-leaf bits"


def test_token_chunks_cover_the_batch():
    """The swapped kernel's row tile: two powers of two (8 to 128 each) that cover m up to 256 rows."""
    token_chunks = importlib.import_module("kernels.triton.matmul").token_chunks
    for m in range(1, 1025):
        head, tail = token_chunks(m)
        assert all(8 <= c <= 128 and c & (c - 1) == 0 for c in (head, tail)), (m, head, tail)
        assert head + tail >= min(m, 256), (m, head, tail)
    assert [token_chunks(m) for m in (72, 128, 136, 144, 168, 256)] == [
        (64, 8), (64, 64), (128, 8), (128, 16), (128, 64), (128, 128)]


def test_swapped_table_entries_apply_where_measured(kt):
    """Swapped launches only for bf16 outputs at decode sizes, trees of 4 or 8 segments, and products
    wide enough to keep half the SMs busy (Llama-3.1-8B's o at 136 rows yes, Qwen2.5-1.5B's no)."""
    assert kt.pick_config(136, 4096, 4096, 8).swap_ab and kt.pick_config(136, 6144, 4096, 1).swap_ab
    assert kt.pick_config(168, 4096, 14336, 8).swap_ab
    assert not kt.pick_config(136, 1536, 1536, 8).swap_ab  # 24 tiles of 64 rows: too few programs
    assert not kt.pick_config(136, 4096, 4096, 2).swap_ab  # 2-segment trees take the pairs kernel
    assert not kt.pick_config(136, 6144, 4096, 1, torch.float32).swap_ab
    assert not kt.pick_config(256, 4096, 4096, 8).swap_ab
    # below 65 rows: qkv at every size, gate_up to 40 rows, the trees from 33 rows
    assert kt.pick_config(8, 6144, 4096, 1).swap_ab and kt.pick_config(64, 6144, 4096, 1).swap_ab
    assert kt.pick_config(40, 28672, 4096, 1).swap_ab and not kt.pick_config(48, 28672, 4096, 1).swap_ab
    assert kt.pick_config(48, 4096, 4096, 8).swap_ab and not kt.pick_config(32, 4096, 4096, 8).swap_ab
    # Qwen2.5-1.5B's gate_up: 140 tiles of 128 weight rows fill two waves of 132 SMs at 53%
    assert not kt.pick_config(40, 17920, 1536, 1).swap_ab and not kt.pick_config(136, 17920, 1536, 1).swap_ab
    # column chunks (128 x 96 tiles) for Llama-3.1-8B's qkv at 209-256 rows only, bf16 out
    assert kt.pick_config(232, 6144, 4096, 1).weight_chunks == (64, 32)
    assert kt.pick_config(256, 6144, 4096, 1).weight_chunks == (64, 32)
    assert not kt.pick_config(200, 6144, 4096, 1).weight_chunks
    assert not kt.pick_config(232, 6144, 4096, 1, torch.float32).weight_chunks
    with pytest.raises(ValueError, match="weight_chunks"):  # the chunks must make up the tile's columns
        kt.MMConfig(128, 128, 4, 8, gluon=True, weight_chunks=(64, 32))


@needs_cuda
def test_gluon_tree_kernel_runs_on_hopper(kt):
    """On an H100/H200 the launch table's entries for M >= 128 really take the Gluon kernel
    (so the bit-equality tests above exercise it, not its fallback)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for sm90")
    mm = importlib.import_module("kernels.triton.matmul")  # (kernels.triton.matmul is the function)
    sm90 = mm._sm90()
    assert sm90 is not None, "this Triton has no Gluon"
    x, w = randn(1024, 4096, seed=11), randn(4096, 4096, seed=12, scale=0.02)
    assert kt.pick_config(1024, 4096, 4096, 8).gluon and sm90.supported(x, w, 8)
    assert kt.pick_config(2048, 6144, 4096, 1).gluon and sm90.supported(x, w, 1)  # plain products too
    # Qwen2.5-1.5B's down: segments of 1,120 end mid-tile, read through the segment view
    assert kt.pick_config(4096, 1536, 8960, 8).gluon and sm90.supported(randn(64, 8960), randn(1536, 8960), 8)
    assert not sm90.supported(randn(64, 8968, seed=13), randn(1536, 8968, seed=14), 8)  # 1,121: not on 16 bytes


@needs_cuda
@pytest.mark.parametrize("m", [8, 72, 136, 200, 1000])
def test_segments_ending_mid_tile_bitwise_identical(kt, m):
    """Qwen2.5-1.5B's down (K = 8960 in 8 segments of 1,120: 17.5 K tiles each): the Gluon kernels read it
    through a segment view, TMA zero-filling each segment's last tile. Plain, split, swapped and
    column-chunk tiles and the table's launch give the bits of the Triton kernel's masked loads; the
    4-leaf tree (whose segments end on tiles) does not."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for sm90")
    C = kt.MMConfig
    x, w = randn(m, 8960, seed=19), randn(1536, 8960, seed=20, scale=0.02)
    assert importlib.import_module("kernels.triton.matmul")._sm90().supported(x, w, 8)
    base = kt.matmul_with_config(x, w, None, 8, BF, C(64, 64, 4, 2))
    configs = _swapped_configs(kt, tree=True) + [
        C(128, 128, 8, 5, gluon=True, tma_store=True), C(64, 128, 4, 6, gluon=True, group_m=1),
        C(128, 128, 8, 5, gluon=True, seg_per_prog=4), C(64, 128, 4, 6, gluon=True, seg_per_prog=2)]
    for cfg in configs + [None]:
        out = kt.matmul_with_config(x, w, None, 8, BF, cfg)
        assert same_bits(out, base), f"M={m}: config {cfg or 'of the table'} differs"
    control = kt.matmul_with_config(x, w, None, 4, BF, C(128, 128, 8, 5, gluon=True))
    assert not same_bits(control, base), f"M={m}: the 4-leaf tree gave the 8-leaf bits"


def test_matmul_segment_tree_equals_combined_partials(kt):
    m, k_dim, n_dim = (20, 512, 96) if INTERPRET else (100, 14336, 4096)
    x = randn(m, k_dim, seed=9)
    w = randn(n_dim, k_dim, seed=10, scale=0.02)
    b = randn(n_dim, seed=11)
    parts = kt.matmul_partials(x, w, 8)
    assert parts.shape == (8, m, n_dim) and parts.dtype == torch.float32
    p = list(parts.unbind(0))
    tree = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    want = tree + b.float()
    assert same_bits(kt.matmul(x, w, b, segments=8, out_dtype=torch.float32), want)
    if not INTERPRET:  # the interpreter truncates to bf16 instead of rounding
        assert same_bits(kt.matmul(x, w, b, segments=8), want.to(BF))
    # TP=2: rank r holds K half r (strided views); its 4 partials are segments 4r..4r+3 of TP=1
    for r in (0, 1):
        sl = slice(r * k_dim // 2, (r + 1) * k_dim // 2)
        assert same_bits(kt.matmul_partials(x[:, sl], w[:, sl], 4), parts[4 * r:4 * r + 4])
    # segment s of the partials is an ordinary plain matmul over its K slice
    seg = k_dim // 8
    for s in (0, 5):
        plain = kt.matmul(x[:, s * seg:(s + 1) * seg].contiguous(), w[:, s * seg:(s + 1) * seg].contiguous(),
                          out_dtype=torch.float32)
        assert same_bits(plain, p[s])


def test_matmul_close_to_reference(kt):
    from kernels import reference as R
    m, k_dim, n_dim = (6, 256, 64) if INTERPRET else (33, 512, 320)
    x = randn(m, k_dim, seed=12)
    w = randn(n_dim, k_dim, seed=13, scale=0.05)
    b = randn(n_dim, seed=14)
    for segments in (1, 8):
        want = R.matmul(x, w, b, segments=segments, out_dtype=torch.float32)
        got = kt.matmul(x, w, b, segments=segments, out_dtype=torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        got16 = kt.matmul(x, w, b, segments=segments)
        torch.testing.assert_close(got16.float(), want, rtol=1.6e-2, atol=1e-2)
    parts = kt.matmul_partials(x, w, 4)
    torch.testing.assert_close(parts, R.matmul_partials(x, w, 4), rtol=1e-4, atol=1e-4)
    # 3-D input, non-contiguous weight view
    x3 = randn(2, 3, k_dim, seed=15)
    wt = randn(k_dim, n_dim, seed=16, scale=0.05).t()
    torch.testing.assert_close(kt.matmul(x3, wt, out_dtype=torch.float32),
                               (x3.float() @ wt.float().t()), rtol=1e-4, atol=1e-4)


@needs_cuda
def test_matmul_close_to_cublas_llama(kt):
    x = randn(256, 14336, seed=17)
    w = randn(4096, 14336, seed=18, scale=0.02)
    want = torch.nn.functional.linear(x.float(), w.float())
    for segments in (1, 8):
        torch.testing.assert_close(kt.matmul(x, w, segments=segments, out_dtype=torch.float32), want,
                                   rtol=1e-3, atol=1e-3)


@needs_cuda
def test_negative_control_cublas_is_not_batch_invariant(kt):
    """torch.matmul (cuBLAS) changes row 0 with the batch size on Llama-3.1-8B shapes; ours doesn't."""
    differs = {}
    for name, k_dim, n_dim in [("qkv", 4096, 6144), ("down", 14336, 4096)]:
        x = randn(1024, k_dim, seed=19)
        w = randn(n_dim, k_dim, seed=20, scale=0.02)
        alone = torch.matmul(x[:1], w.t())
        ours_alone = kt.matmul(x[:1], w, segments=8 if name == "down" else 1)
        for m in (8, 16, 32, 64, 128, 256, 512, 1024):
            if not same_bits(torch.matmul(x[:m], w.t())[:1], alone):
                differs.setdefault(name, []).append(m)
            assert same_bits(kt.matmul(x[:m], w, segments=8 if name == "down" else 1)[:1], ours_alone)
    print("cuBLAS row 0 differs from M=1 at:", differs)
    assert differs, "cuBLAS was batch-invariant on every shape: the negative control shows nothing"


# ----------------------------------------------------------------------------------------------- norms

@pytest.mark.parametrize("n", [128, 4096, 5120, 300])
def test_rms_norm_invariance_and_closeness(kt, n):
    from kernels import reference as R
    m_full = 70 if INTERPRET else 1500
    x = randn(m_full, n, seed=21, scale=3.0)
    w = randn(n, seed=22)
    full = kt.rms_norm(x, w, 1e-6)
    rng = random.Random(n)
    for m in ([1, 2, 7, 64] if INTERPRET else list(range(1, 65)) + [300, 1024]):
        off = rng.randrange(0, m_full - m + 1)
        assert same_bits(kt.rms_norm(x[off:off + m], w, 1e-6), full[off:off + m])
    # 3-D [B, T, H, D] input as q/k norm uses
    assert same_bits(kt.rms_norm(x[:64].reshape(4, 16, 1, n), w, 1e-6).reshape(64, n), full[:64])
    want = R.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(full.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    if not INTERPRET:  # the interpreter truncates to bf16 instead of rounding
        assert (full == want).float().mean().item() > 0.95  # most elements agree exactly


@pytest.mark.parametrize("n", [1536, 4096, 128, 300])
def test_add_rms_norm_equals_add_then_rms_norm_bitwise(kt, n):
    """The fused residual add + norm gives add's and rms_norm's bits, at any row count and on strided rows."""
    m_full = 40 if INTERPRET else 700
    a = randn(m_full, n, seed=31, scale=4.0)
    b = randn(m_full, 2 * n, seed=32)[:, :n]  # a strided view, as a split projection is
    w = randn(n, seed=33)
    for m in ([1, 5, 40] if INTERPRET else [1, 7, 64, 256, 700]):
        s, y = kt.add_rms_norm(a[:m], b[:m], w, 1e-6)
        want_s = kt.add(a[:m], b[:m].contiguous())
        assert same_bits(s, want_s)
        assert same_bits(y, kt.rms_norm(want_s, w, 1e-6))
    # the comparison can fail: a norm of the unrounded fp32 sum gives other bits
    s, y = kt.add_rms_norm(a, b, w, 1e-6)
    unrounded = (a.float() + b.float()) * torch.rsqrt((a.float() + b.float()).pow(2).mean(-1, keepdim=True) + 1e-6)
    assert not same_bits(y, (w.float() * unrounded).to(BF))


def test_rotary_qk_equals_two_rotary_launches_bitwise(kt):
    """q and k rotated in one launch, read straight from a fused qkv output (strided views)."""
    b, t, hq, hkv, d = 3, 5, 12, 2, 128
    qkv = randn(b, t, (hq + 2 * hkv) * d, seed=41)
    q, k, _ = (p.view(b, t, -1, d) for p in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    ang = torch.rand(b, t, d // 2, generator=torch.Generator().manual_seed(42)) * 100
    cos, sin = ang.cos().to(qkv.device), ang.sin().to(qkv.device)
    q_rot, k_rot = kt.rotary_qk(q, k, cos, sin)
    assert same_bits(q_rot, kt.rotary(q, cos, sin)) and same_bits(k_rot, kt.rotary(k, cos, sin))
    assert not same_bits(k_rot, kt.rotary(k, sin, cos))  # the comparison can fail


def test_forward_with_fused_ops_equals_the_op_by_op_forward(kt):
    """The decoder forward without autograd (deferred residual adds, fused launches) against the same
    forward with the fused forms switched off: the same hidden states, bit for bit."""
    import dataclasses

    from kernels.forward import forward_hidden
    from kernels.opset import CANONICAL_OPS
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(DEV, BF).eval()
    ids = torch.randint(0, 512, (2, 24), generator=gen(43), device=DEV)
    pos = torch.arange(24, device=DEV).expand(2, -1)
    op_by_op = dataclasses.replace(CANONICAL_OPS, fused_add_rms_norm=None, fused_rotary_qk=None)
    with torch.no_grad():
        fused = forward_hidden(model, ids, pos)
        plain = forward_hidden(model, ids, pos, ops=op_by_op)
    with torch.enable_grad():  # the trainer's form: every layer adds its own residual
        trained = forward_hidden(model, ids, pos)
    assert same_bits(fused, plain) and same_bits(fused, trained.detach())


@needs_cuda  # the interpreter's bf16 dots are not a model's numbers (numpy has no bf16)
@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     ("q_proj", "v_proj")])
def test_lora_expand_add_in_a_forward_equals_the_expand_then_lora_add(kt, targets, tmp_path):
    """A forward with adapters held in the base weights (as the vLLM plugin holds them): the expands and
    epilogues in one launch per term or per group (CANONICAL_OPS) against the expand then lora_add (the op set
    without lora_expand_add), tokens of two adapters and of none."""
    import dataclasses
    import sys

    from kernels.forward import forward_hidden, fuse_projections
    from kernels.lora import LoraRows
    from kernels.opset import CANONICAL_OPS
    from rollout_service.tiny_models import tiny_model
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lora_shared import random_adapter
    tiny_model("qwen2", seed=3, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512,
               num_layers=2).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=BF).to(DEV).eval()
    adapters = [random_adapter(model, r, targets, seed).weights(f"slot{i}", DEV)
                for i, (r, seed) in enumerate(((16, 1), (8, 2)))]
    fuse_projections(model, tuple(adapters))
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=gen(44), device=DEV)
    pos = torch.arange(12, device=DEV).expand(1, -1)
    picks = torch.arange(12, device=DEV).view(1, 12) % 3  # adapter 0, 1 or none per token
    rows = LoraRows(tuple((w, picks == i) for i, w in enumerate(adapters)))
    with torch.no_grad():
        fused = forward_hidden(model, ids, pos, lora=rows)
        apart = forward_hidden(model, ids, pos, lora=rows, ops=dataclasses.replace(CANONICAL_OPS, lora_expand_add=None))
        base = forward_hidden(model, ids, pos)
    assert same_bits(fused, apart)
    assert not same_bits(fused[picks == 0], base[picks == 0])  # the comparison can fail: the adapters matter


@pytest.mark.parametrize("v", [128256, 1000])
def test_log_softmax_invariance_and_closeness(kt, v):
    if INTERPRET and v > 5000:
        pytest.skip("slow in the interpreter")
    m_full = 300 if not INTERPRET else 9
    x = randn(m_full, v, dtype=torch.float32, seed=23, scale=4.0)
    x[3, ::7] = float("-inf")  # masked vocabulary
    full = kt.log_softmax(x)
    rng = random.Random(v)
    for m in ([1, 2, 5] if INTERPRET else [1, 2, 3, 8, 31, 64, 65, 200]):
        off = rng.randrange(0, m_full - m + 1)
        assert same_bits(kt.log_softmax(x[off:off + m]), full[off:off + m])
    want = torch.log_softmax(x.double(), dim=-1).float()
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(full))
    torch.testing.assert_close(full[fin], want[fin], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("v", [151936, 4097, 1000])
def test_token_log_softmax_equals_the_full_log_softmax_bitwise(kt, v):
    """The rollout's one-entry-per-row log-prob (kernels.token_logprobs without grad) has the bits of
    the trainer's full canonical log_softmax of logits / T, gathered; torch's own log_softmax does not."""
    from kernels.logprobs import scale_logits, token_logprobs
    if INTERPRET and v > 5000:
        pytest.skip("slow in the interpreter")
    n = 64 if not INTERPRET else 6
    x = randn(n, v, dtype=torch.float32, seed=29, scale=4.0)
    x[1, ::5] = float("-inf")  # a masked vocabulary
    temps = [(0.0, 0.7, 1.0, 1.3, 0.35)[i % 5] for i in range(n)]
    g = gen(31)
    tokens = torch.randint(0, v, (n,), generator=g, device=DEV)
    tokens[0] = x[0].argmax()
    tokens[1] = 5  # a masked id: log-prob -inf
    t_rows = [t if t > 0 else 1.0 for t in temps]
    full = kt.log_softmax(scale_logits(x, t_rows)).gather(1, tokens[:, None]).squeeze(1)
    fused = kt.token_log_softmax(x, torch.tensor(t_rows, device=DEV), tokens)
    assert same_bits(fused, full) and fused[1] == float("-inf")
    with torch.no_grad():
        if INTERPRET:  # CPU tensors: the public op runs the reference
            return
        assert same_bits(token_logprobs(x, temps, tokens), full)  # the public op takes the fused kernel
        one_t = kt.log_softmax(scale_logits(x, 0.7)).gather(1, tokens[:, None]).squeeze(1)
        assert same_bits(token_logprobs(x, 0.7, tokens), one_t)
    torch_lp = torch.log_softmax(scale_logits(x, t_rows), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    fin = torch.isfinite(full)
    torch.testing.assert_close(fused[fin], torch_lp[fin], rtol=1e-5, atol=2e-5)
    if not INTERPRET:  # the negative control: another log-softmax's rounding shows up
        assert not same_bits(fused, torch_lp), "torch's log_softmax matched bit for bit: this test cannot fail"


def test_silu_mul_invariance_and_closeness(kt):
    from kernels import reference as R
    gu = randn(130, 2 * 3000, seed=24, scale=3.0)
    gate, up = gu[:, :3000], gu[:, 3000:]  # views, as after a fused gate_up projection
    full = kt.silu_mul(gate, up)
    for m, off in [(1, 0), (1, 77), (13, 40), (64, 66)]:
        assert same_bits(kt.silu_mul(gate[off:off + m], up[off:off + m]), full[off:off + m])
        assert same_bits(kt.silu_mul(gate[off:off + m].contiguous(), up[off:off + m].contiguous()),
                         full[off:off + m])
    torch.testing.assert_close(full.float(), R.silu_mul(gate, up).float(), rtol=1.6e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------- attention

def _attention_module():
    """kernels.triton.attention, the module (`import ... as` would give the package's attention
    function of the same name, and setting the test hooks on it would change nothing)."""
    return importlib.import_module("kernels.triton.attention")


def _attn_case(b, length, hq, hkv, d, seed):
    q = randn(b, length, hq, d, seed=seed)
    k = randn(b, length, hkv, d, seed=seed + 1)
    v = randn(b, length, hkv, d, seed=seed + 2)
    lengths = [length - 37 * i for i in range(b)]
    pos = torch.full((b, length), -1, dtype=torch.int64, device=DEV)
    for i, n in enumerate(lengths):
        pos[i, :n] = torch.arange(n, device=DEV)
    return q, k, v, pos, lengths


def _stale(kv: torch.Tensor, upto: int) -> torch.Tensor:
    """Contiguous cache holding positions 0..upto; everything later is garbage (NaN)."""
    out = kv.clone()
    out[:, upto + 1:] = float("nan")
    return out


def _paged(kv: torch.Tensor, block_size: int, seed: int):
    """Scatter contiguous [B, L, H, D] into shuffled pages (+ NaN spare pages); returns cache, table."""
    b, length, h, d = kv.shape
    nb = -(-length // block_size)
    total = b * nb + 5
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[: b * nb].reshape(b, nb)
    cache = torch.full((total, block_size, h, d), float("nan"), dtype=kv.dtype, device=kv.device)
    padded = torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, nb * block_size - length), value=float("nan"))
    cache[perm.reshape(-1).to(kv.device)] = padded.reshape(b * nb, block_size, h, d)
    return cache, perm.to(torch.int32).to(kv.device)


ATTN_CASES = [(3, 200, 8, 2, 128), (2, 150, 4, 4, 64)] if not INTERPRET else [(2, 80, 4, 2, 32)]


@pytest.mark.parametrize("b,length,hq,hkv,d", ATTN_CASES)
def test_attention_whole_equals_decode_chunks_paged(kt, b, length, hq, hkv, d):
    q, k, v, pos, lengths = _attn_case(b, length, hq, hkv, d, seed=30)
    whole = kt.attention(q, k, v, pos)
    assert (whole[1, lengths[1]:] == 0).all()  # padding rows
    # token-by-token decode over a cache that holds only the past (the future is NaN garbage)
    for t in range(length):
        step = kt.attention(q[:, t:t + 1], _stale(k, t), _stale(v, t), pos[:, t:t + 1])
        assert same_bits(step, whole[:, t:t + 1]), f"decode step t={t}"
    # random chunking (prefill chunks / verify windows)
    rng = random.Random(length)
    start = 0
    while start < length:
        end = min(length, start + rng.choice([1, 3, 16, 17, 64, 65, 100]))
        chunk = kt.attention(q[:, start:end], _stale(k, end - 1), _stale(v, end - 1), pos[:, start:end])
        assert same_bits(chunk, whole[:, start:end]), f"chunk {start}:{end}"
        start = end
    # paged caches with shuffled block tables, block sizes below, at and above the KV block
    for bs in (16, 64, 128):
        kc, table = _paged(k, bs, seed=bs)
        vc, _ = _paged(v, bs, seed=bs)
        assert same_bits(kt.attention(q, kc, vc, pos, block_table=table), whole), f"paged bs={bs}"
        t0, t1 = length // 3, length // 3 + 5
        assert same_bits(kt.attention(q[:, t0:t1], kc, vc, pos[:, t0:t1], block_table=table), whole[:, t0:t1])
    # each sequence alone equals its row in the batch; int32 positions too
    for i in range(b):
        alone = kt.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], pos[i:i + 1].to(torch.int32))
        assert same_bits(alone, whole[i:i + 1])


@needs_cuda  # 65,600 programs: far too many for the interpreter
def test_attention_more_sequences_than_a_grid_axis_holds(kt):
    """vLLM's profiling run feeds every token as its own sequence: 16,400 sequences x 4 KV heads are
    65,600 (batch, head) programs, past the 65,535 a CUDA grid's y axis holds."""
    b, hq, hkv, d = 16400, 32, 4, 128
    q, k, v = randn(b, 1, hq, d, seed=50), randn(b, 1, hkv, d, seed=51), randn(b, 1, hkv, d, seed=52)
    pos = torch.zeros(b, 1, dtype=torch.int64, device=DEV)
    whole = kt.attention(q, k, v, pos)
    part = kt.attention(q[-16:], k[-16:], v[-16:], pos[-16:])
    assert same_bits(whole[-16:], part)
    assert same_bits(whole[-1:].float(), v[-1:].repeat_interleave(hq // hkv, dim=2).float())  # one key: its value


@pytest.mark.parametrize("b,length,hq,hkv,d", ATTN_CASES[:1])
def test_attention_tile_configs_bitwise_identical(kt, b, length, hq, hkv, d):
    A = _attention_module()
    q, k, v, pos, _ = _attn_case(b, length, hq, hkv, d, seed=40)
    base = kt.attention(q, k, v, pos)
    try:
        for tile in [(16, 4, 2), (64, 4, 3), (128, 8, 2), (128, 8, 3), (128, 4, 2), (32, 4, 3)]:
            A._FORCED_TILE = tile
            assert same_bits(kt.attention(q, k, v, pos), base), f"tile {tile}"
    finally:
        A._FORCED_TILE = None


def test_attention_decode_tiles_bitwise_identical(kt):
    """A decode step (a program per split, then the merge; or one program walking the splits) gives the
    prefill's rows under every decode launch configuration the schedule picks or could pick."""
    A = _attention_module()
    b, length, hq, hkv, d, split = (2, 1300, 12, 2, 128, A.SPLIT_KV) if not INTERPRET else (2, 150, 4, 2, 32, 64)
    q, k, v, pos, lengths = _attn_case(b, length, hq, hkv, d, seed=44)
    whole = kt.attention(q, k, v, pos, split_kv=split)
    seq, last = torch.arange(b, device=DEV), torch.tensor([n - 1 for n in lengths], device=DEV)
    want = whole[seq, last][:, None]
    try:
        for parallel in (True, False):  # a program per split, or one walking them (many sequences)
            A._FORCED_PARALLEL_SPLITS = parallel
            for tile in [None, (16, 4, 4), (16, 8, 2), (16, 2, 1), (16, 2, 2), (16, 4, 2), (16, 1, 3)]:
                A._FORCED_TILE = tile
                step = kt.attention(q[seq, last][:, None], k, v, last[:, None], split_kv=split)
                assert same_bits(step, want), f"tile {tile} parallel={parallel}"
    finally:
        A._FORCED_TILE = A._FORCED_PARALLEL_SPLITS = None
    if not INTERPRET:  # the comparison can fail: another split size gives other bits (the interpreter's
        # truncating bf16 casts make this small case agree)
        assert not same_bits(kt.attention(q[seq, last][:, None], k, v, last[:, None], split_kv=2 * split), want)


def test_attention_key_offsets_32_and_64_bit_identical(kt):
    """Caches spanning fewer than 2**31 elements address keys by 32-bit offsets, larger ones by 64-bit:
    addresses only, so prefill rows and decode steps (both schedules) have the same bits either way."""
    A = _attention_module()
    b, length, hq, hkv, d = ATTN_CASES[0]
    q, k, v, pos, lengths = _attn_case(b, length, hq, hkv, d, seed=46)
    kc, table = _paged(k, 16, seed=3)
    vc, _ = _paged(v, 16, seed=3)
    seq, last = torch.arange(b, device=DEV), torch.tensor([n - 1 for n in lengths], device=DEV)

    def runs():
        out = [kt.attention(q, k, v, pos), kt.attention(q, kc, vc, pos, block_table=table)]
        for parallel in (True, False):
            A._FORCED_PARALLEL_SPLITS = parallel
            out.append(kt.attention(q[seq, last][:, None], kc, vc, last[:, None], block_table=table, split_kv=64))
        A._FORCED_PARALLEL_SPLITS = None
        return out
    limit = A._OFFSETS_32_LIMIT
    try:
        assert max(A._span(kc), A._span(k)) <= limit
        narrow = runs()
        A._OFFSETS_32_LIMIT = 0  # every cache takes 64-bit offsets
        wide = runs()
    finally:
        A._OFFSETS_32_LIMIT, A._FORCED_PARALLEL_SPLITS = limit, None
    for i, (x, y) in enumerate(zip(narrow, wide)):
        assert same_bits(x, y), i


def _pack(q, pos, table, pieces):
    """vLLM's flat token batch: the (sequence, start, end) query pieces back to back, then 3 padding
    rows; returns (q, positions, block table rows, starts, lens) for attention_packed."""
    idx = [(i, t) for i, s, e in pieces for t in range(s, e)] + [(0, 0)] * 3
    seqs, ts = (torch.tensor(x, device=q.device) for x in zip(*idx))
    lens = torch.tensor([e - s for _, s, e in pieces], device=q.device)
    starts = torch.cumsum(lens, 0) - lens
    return q[seqs, ts], pos[seqs, ts], table[torch.tensor([i for i, _, _ in pieces], device=q.device)], starts, lens


@pytest.mark.parametrize("b,length,hq,hkv,d", ATTN_CASES[:1])
def test_attention_packed_equals_padded(kt, b, length, hq, hkv, d):
    """vLLM's prefill steps: chunks of several sequences, or single decode tokens, back to back in one
    flat batch attend in place over the paged cache. Every row equals the padded layout's, rows of no
    sequence are left untouched, under each split schedule and tile."""
    A = _attention_module()
    q, k, v, pos, lengths = _attn_case(b, length, hq, hkv, d, seed=80)
    whole = kt.attention(q, k, v, pos)
    kc, table = _paged(k, 16, seed=5)
    vc, _ = _paged(v, 16, seed=5)
    rng = random.Random(length)
    chunks = [(i, s, s + rng.randint(2, 20)) for i, n in enumerate(lengths) for s in [rng.randrange(0, n - 20)]]
    singles = [(i, n - 1, n) for i, n in enumerate(lengths)]
    cases = [(chunks, None, None), (chunks, None, (128, 8, 2)), (singles, None, None), (singles, True, None),
             (singles, False, None)]
    try:
        for pieces, parallel, tile in cases:
            pieces = rng.sample(pieces, len(pieces))  # the batch's order is not the sequences'
            fq, fpos, ftable, starts, lens = _pack(q, pos, table, pieces)
            out = torch.full_like(fq, float("nan"))
            A._FORCED_PARALLEL_SPLITS, A._FORCED_TILE = parallel, tile
            kt.attention_packed(fq, kc, vc, fpos, ftable, starts, lens, int(lens.max()), out)
            for (i, s, e), start in zip(pieces, starts.tolist()):
                assert same_bits(out[start:start + e - s], whole[i, s:e]), f"{(i, s, e)} {parallel} {tile}"
            assert out[-3:].isnan().all(), "rows of no sequence must be left as they were"
    finally:
        A._FORCED_PARALLEL_SPLITS = A._FORCED_TILE = None


# (b, length, hq, hkv, d, split_kv); None: the contract's split
SPLIT_CASES = ([(2, 1300, 8, 2, 128, None), (3, 700, 12, 2, 128, 128)] if not INTERPRET
               else [(2, 150, 4, 2, 32, 64)])


@pytest.mark.parametrize("b,length,hq,hkv,d,split", SPLIT_CASES)
def test_attention_split_kv_decode_equals_prefill(kt, b, length, hq, hkv, d, split):
    """A decode step reduces a long context's splits in programs of their own and merges them in a
    second kernel; prefill walks the splits in one program. Same bits at every position tried (around
    split boundaries and at random), contiguous or paged, on either path; another split size changes
    the rows past the first split (negative control)."""
    A = _attention_module()
    split = split or A.SPLIT_KV
    q, k, v, pos, lengths = _attn_case(b, length, hq, hkv, d, seed=70)
    whole = kt.attention(q, k, v, pos, split_kv=split)
    kc, table = _paged(k, 16, seed=3)
    vc, _ = _paged(v, 16, seed=3)
    edges = {0, 1, split - 1, split, split + 1, 2 * split - 1, 2 * split, length - 1}
    steps = sorted({t for t in edges if t < length} | set(random.Random(length).sample(range(length), 12)))
    try:
        for forced in (None, False, True):  # the shape's choice (one program per split here), walk, split
            A._FORCED_PARALLEL_SPLITS = forced
            for t in steps:
                step = kt.attention(q[:, t:t + 1], _stale(k, t), _stale(v, t), pos[:, t:t + 1], split_kv=split)
                assert same_bits(step, whole[:, t:t + 1]), f"decode t={t} forced={forced}"
                paged = kt.attention(q[:, t:t + 1], kc, vc, pos[:, t:t + 1], block_table=table, split_kv=split)
                assert same_bits(paged, whole[:, t:t + 1]), f"paged decode t={t} forced={forced}"
            t0 = min(split - 2, length - 5)  # a verify window across a split boundary
            window = kt.attention(q[:, t0:t0 + 5], kc, vc, pos[:, t0:t0 + 5], block_table=table, split_kv=split)
            assert same_bits(window, whole[:, t0:t0 + 5]), f"window forced={forced}"
    finally:
        A._FORCED_PARALLEL_SPLITS = None
    other = kt.attention(q, k, v, pos, split_kv=2 * split)
    assert same_bits(other[:, :split], whole[:, :split])  # one split either way
    if not INTERPRET:  # the interpreter's bf16 scores are garbage-sized: every P is one-hot there
        assert not same_bits(other[:, split:], whole[:, split:])


@pytest.mark.parametrize("b,length,hq,hkv,d", ATTN_CASES)
def test_attention_close_to_reference(kt, b, length, hq, hkv, d):
    from kernels import reference as R
    q, k, v, pos, _ = _attn_case(b, length, hq, hkv, d, seed=50)
    got = kt.attention(q, k, v, pos, scale=0.1)
    want = R.attention(q, k, v, pos, scale=0.1)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    if not INTERPRET:
        kf = k.float().repeat_interleave(hq // hkv, dim=2)
        vf = v.float().repeat_interleave(hq // hkv, dim=2)
        s = torch.einsum("bthd,blhd->bhtl", q.float(), kf) * 0.1
        vis = torch.arange(length, device=DEV)[None, None, None, :] <= pos[:, None, :, None]
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
        exact = torch.einsum("bhtl,blhd->bthd", p, vf)
        torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------------- public dispatch

@needs_cuda
def test_public_ops_dispatch_to_triton_with_reference_grad(kt):
    import kernels as K
    x = randn(5, 256, seed=60)
    assert K.backend_for(x) is kt
    w = randn(128, 256, seed=61, scale=0.05).requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    y = K.matmul(xg, w, row_parallel=True)
    assert same_bits(y.detach(), kt.matmul(x, w.detach(), segments=K.tree_segments()))
    y.float().sum().backward()
    assert xg.grad is not None and w.grad is not None
    q, k, v, pos, _ = _attn_case(2, 40, 4, 2, 64, seed=62)
    assert same_bits(K.attention(q, k, v, pos), kt.attention(q, k, v, pos))
    logits = randn(3, 1000, dtype=torch.float32, seed=63)
    assert same_bits(K.log_softmax(logits), kt.log_softmax(logits))


@needs_cuda
def test_fused_training_nodes_give_the_bits_of_the_ops_one_by_one(kt):
    """With a gradient, add + rms_norm and RoPE on q and k still run as one launch each: forward and
    backward bits those of the ops one by one."""
    import kernels as K
    a, b = (randn(300, 1536, seed=s).requires_grad_() for s in (80, 81))
    w = (1 + randn(1536, seed=82) / 4).requires_grad_()
    grads = randn(300, 1536, seed=83), randn(300, 1536, seed=84)
    fused = K.add_rms_norm(a, b, w, 1e-6)
    s = K.add(a, b)
    apart = s, K.rms_norm(s, w, 1e-6)
    assert all(same_bits(x.detach(), y.detach()) for x, y in zip(fused, apart))
    got, want = (torch.autograd.grad(out, (a, b, w), grads) for out in (fused, apart))
    assert all(same_bits(x, y) for x, y in zip(got, want))
    q, k = randn(2, 150, 12, 128, seed=85).requires_grad_(), randn(2, 150, 2, 128, seed=86).requires_grad_()
    angle = randn(2, 150, 64, dtype=torch.float32, seed=87)
    grads = randn(2, 150, 12, 128, seed=88), randn(2, 150, 2, 128, seed=89)
    fused = K.rotary_qk(q, k, angle.cos(), angle.sin())
    apart = K.rotary(q, angle.cos(), angle.sin()), K.rotary(k, angle.cos(), angle.sin())
    assert all(same_bits(x.detach(), y.detach()) for x, y in zip(fused, apart))
    got, want = (torch.autograd.grad(out, (q, k), grads) for out in (fused, apart))
    assert all(same_bits(x, y) for x, y in zip(got, want))


@needs_cuda
def test_attention_backward_takes_flash_over_whole_sequences(kt, monkeypatch):
    """Whole sequences: the flash kernels' backward, no nested autograd pass (attention_ref is not
    called), gradients close to fp32 autograd. Padded rows: the nested pass through attention_ref."""
    import kernels as K
    from conftest import attention_fp32
    from kernels import backward as B
    nested = []
    real_ref = B.attention_ref
    monkeypatch.setattr(B, "attention_ref", lambda *a: nested.append(1) or real_ref(*a))
    for padded in (False, True):
        q, k, v, pos, _ = _attn_case(2, 300, 12, 2, 128, seed=90)
        if not padded:
            pos = torch.arange(300, device=DEV).repeat(2, 1)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        g = randn(2, 300, 12, 128, dtype=torch.float32, seed=93)
        g[pos < 0] = 0  # nothing downstream uses a padding row
        got = torch.autograd.grad(K.attention(q, k, v, pos, scale=128 ** -0.5), (q, k, v), g.to(BF))
        want = torch.autograd.grad(attention_fp32(q, k, v, pos, 128 ** -0.5), (q, k, v), g)
        assert len(nested) == int(padded)
        for a, e in zip(got, want):
            assert a.shape == e.shape and torch.isfinite(a).all()
            assert (a.float() - e).norm() / e.norm() < 2e-2


@needs_cuda
def test_reference_ops_are_invariant_on_cuda():
    """The CPU oracle's own properties hold when it runs on CUDA tensors (torch elementwise ops)."""
    from kernels import reference as R
    x = randn(40, 96, seed=70)
    w = randn(48, 96, seed=71)
    full = R.matmul(x, w, segments=4)
    assert same_bits(R.matmul(x[5:6], w, segments=4), full[5:6])
    xn = randn(40, 256, seed=72)
    wn = randn(256, seed=73)
    assert same_bits(R.rms_norm(xn[9:12], wn, 1e-5), R.rms_norm(xn, wn, 1e-5)[9:12])
    lg = randn(20, 3000, dtype=torch.float32, seed=74)
    assert same_bits(R.log_softmax(lg[:3]), R.log_softmax(lg)[:3])


def test_rotary_and_add_equal_the_reference_formulas_bitwise(kt):
    """One fused launch each, FP contraction off: the same bits as the reference's torch ops on GPU."""
    from kernels import reference
    x = randn(3, 7, 12, 128, seed=21)
    ang = torch.rand(3, 7, 64, generator=torch.Generator().manual_seed(22)) * 100
    cos, sin = ang.cos().to(x.device), ang.sin().to(x.device)
    assert same_bits(kt.rotary(x, cos, sin), reference.rotary(x, cos, sin))
    a, b = randn(5, 9, 1536, seed=23), randn(5, 9, 1536, seed=24)
    assert same_bits(kt.add(a, b), reference.add(a, b))
    assert not same_bits(kt.add(a, b), reference.add(a, b * 1.01))  # the comparison can fail


@pytest.mark.parametrize("layout", ["blocks-first", "kv-interleaved"])
def test_write_kv_equals_index_put_on_strided_pools(kt, layout):
    """One launch writes K and V where the reference's index_put does: vLLM 0.25's [NB, 2, BS, H, D]
    cache unbound into K and V views, and contiguous pools; q/k/v as column splits of one projection."""
    from kernels.reference import ops
    g = gen(0)
    nb, bs, h, d, n = 12, 16, 4, 64, 37
    if layout == "kv-interleaved":
        kp, vp = torch.zeros(nb, 2, bs, h, d, device=DEV, dtype=BF).unbind(1)
    else:
        kp, vp = (torch.zeros(nb, bs, h, d, device=DEV, dtype=BF) for _ in range(2))
    qkv = torch.randn(n, 3 * h * d, device=DEV, generator=g).bfloat16()
    k = qkv[:, : h * d].view(n, h, d)  # non-contiguous rows, as the fused projection's split gives
    v = qkv[:, h * d: 2 * h * d].view(n, h, d)
    slots = torch.randperm(nb * bs, device=DEV, generator=g)[:n]
    blocks, offsets = slots // bs, slots % bs
    want_k, want_v = kp.clone(), vp.clone()
    ops.write_kv(want_k, want_v, blocks, offsets, k, v)
    kt.write_kv(kp, vp, blocks, offsets, k, v)
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)
    assert kp.abs().sum() > 0


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("out_dtype", [BF, torch.float32])
def test_peer_tree_kernels_equal_tree_combine(kt, k, out_dtype):
    """The peer-to-peer tree's kernels (kernels.symm_tree) on k local "peer" nodes: the same bits as
    exact_math.tree_combine + bias, rounded once, for the whole matrix (one shot) and column by column
    (two shots, N not a multiple of k)."""
    from kernels.reference import exact_math as em
    from kernels.triton import peer_tree
    m, n = 37, 4096 + 6
    nodes = [randn(m, n, dtype=torch.float32, seed=40 + j) * (10.0 ** (j % 3)) for j in range(k)]
    bias = randn(n, seed=50)
    want = (em.tree_combine(nodes) + bias.float()).to(out_dtype)
    out = peer_tree.combine_peers(nodes, bias, torch.empty(m, n, dtype=out_dtype, device=DEV))
    assert same_bits(out, want)
    assert same_bits(peer_tree.combine_peers(nodes, None, torch.empty(m, n, dtype=out_dtype, device=DEV)),
                     em.tree_combine(nodes).to(out_dtype))
    # a left fold is another association: the comparison can fail
    fold = nodes[0]
    for t in nodes[1:]:
        fold = fold + t
    if k >= 4:
        assert not same_bits((fold + bias.float()).to(out_dtype), want)
    if out_dtype != BF:
        return
    cols = -(-n // k)
    rounded = []
    for r in range(k):  # each rank rounds its own columns into its own buffer
        mine = torch.zeros(m, n, dtype=BF, device=DEV)
        peer_tree.combine_peer_columns(nodes, bias, mine, r * cols, cols)
        assert not mine[:, :r * cols].any() and not mine[:, (r + 1) * cols:].any()
        rounded.append(mine)
    assert same_bits(peer_tree.gather_peer_columns(rounded, torch.empty(m, n, dtype=BF, device=DEV), cols), want)


@pytest.mark.parametrize("n", [1536, 300, 16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("scale", [2.0, 0.125, pytest.param(1.7, marks=needs_cuda)])
def test_lora_add_equals_mul_add_and_select_bitwise(kt, n, masked, scale):
    """The fused LoRA epilogue gives the bits of torch.mul by the scale, the canonical add and the select it
    replaces, on strided rows (a split projection's output), with -0.0 in base kept on the rows left out.
    Triton's interpreter truncates fp32 -> bf16 where a GPU rounds to nearest even, so on CPU only the power-of-two
    scales (alpha / r as usually set: the scaled product exact in bf16) can match torch.mul."""
    m = 40 if INTERPRET else 700
    base = randn(m, 2 * n, seed=51, scale=3.0)[:, :n]
    base[0, :4] = -0.0
    product = randn(m, n, seed=52, scale=0.05)
    product[0, :4] = 0.0
    mask = (torch.arange(m, device=DEV) % 3 != 0) if masked else None
    got = kt.lora_add(base, product, scale, mask)
    added = kt.add(base.contiguous(), torch.mul(product, scale))
    want = torch.where(mask.unsqueeze(-1), added, base) if masked else added
    assert same_bits(got, want)
    # the comparison can fail: row 0 (-0.0 plus a zero product) is +0.0 when added, -0.0 when left out
    assert same_bits(got[0, :4], base[0, :4]) == masked
    if scale == 1.7:  # and the fp32 sum without rounding the scaled product first gives other bits
        assert not same_bits(got, (base.float() + product.float() * scale).to(BF))


@pytest.mark.parametrize("m", [1, 7, 40] + ([] if INTERPRET else [256, 700]))
@pytest.mark.parametrize("n, r", [(1536, 16), (300, 8), (16, 64)] + ([] if INTERPRET else [(8960, 16), (256, 128),
                                                                                         (1536, 80)]))
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("scale", [2.0, 1.7])
def test_lora_expand_add_equals_the_expand_then_lora_add_bitwise(kt, m, n, r, masked, scale):
    """A LoRA term's expand and epilogue in one launch give the bits of the canonical matmul (bf16 output) then
    lora_add, for h a column block of a wider product (a shrink read out of its base product, as held adapters'
    are) and base a strided view (a fused projection's output), at decode and prefill row counts, ranks of one
    K tile, a partial one and two. Under the interpreter, whose bf16 dots are not numerically right (numpy has
    no bf16), both sides share the matmul's tile loop, so it checks the wiring: which elements each output reads,
    the rounding, the epilogue and the mask."""
    wide = randn(m, 2048 + r + 8, seed=61)
    h = wide[:, 2048:2048 + r]
    b = randn(n, r, seed=62, scale=0.05)
    base = randn(m, 2 * n, seed=63, scale=3.0)[:, :n]
    mask = (torch.arange(m, device=DEV) % 3 != 1) if masked else None
    got = kt.lora_expand_add(base, h, b, scale, mask)
    want = kt.lora_add(base, kt.matmul(h, b), scale, mask)
    assert same_bits(got, want)
    # the comparison can fail: the product scaled in fp32 before its bf16 rounding gives other bits
    unrounded = (base.float() + (kt.matmul(h, b, out_dtype=torch.float32) * scale).to(BF).float()).to(BF)
    if masked:
        unrounded = torch.where(mask.unsqueeze(-1), unrounded, base)
    if m * n >= 256 and math.frexp(scale)[0] != 0.5:  # a power of two scales exactly before or after rounding
        assert not same_bits(got, unrounded)


@pytest.mark.parametrize("m", [3, 40] + ([] if INTERPRET else [256, 1100]))
@pytest.mark.parametrize("widths", [(256, 64, 64), (128, 128), (96, 48, 48), (40, 20, 20)] + ([] if INTERPRET else [
    (1536, 256, 256), (8960, 8960), (4096, 1024, 1024)]))
@pytest.mark.parametrize("masked", [False, True])
def test_lora_expand_add_of_a_group_equals_one_launch_per_member_bitwise(kt, m, widths, masked):
    """A projection group's terms in one launch (each output tile reads its member's block of h) give the bits
    of one launch per member, with members on 128-, 64- and 16-column tile boundaries, and off them (40, 20, 20:
    one launch per member)."""
    r, n = 16, sum(widths)
    wide = randn(m, 2 * n + len(widths) * r, seed=71)
    base, h = wide[:, :n], wide[:, 2 * n:]
    b = randn(n, r, seed=72, scale=0.05)
    mask = (torch.arange(m, device=DEV) % 3 != 1) if masked else None
    got = kt.lora_expand_add(base, h, b, 0.5, mask, widths)
    starts = [sum(widths[:j]) for j in range(len(widths))]
    each = [kt.lora_expand_add(base[:, c:c + w], h[:, j * r:(j + 1) * r], b[c:c + w], 0.5, mask)
            for j, (c, w) in enumerate(zip(starts, widths))]
    assert same_bits(got, torch.cat(each, dim=-1))
    # the comparison can fail: member 0's block of h for every member gives other bits
    assert not same_bits(kt.lora_expand_add(base, h[:, :r].repeat(1, len(widths)), b, 0.5, mask, widths), got)
