"""Canonical grouped expert matmuls (mixture-of-experts layers) and the expert combine.

Rows are grouped by expert: row i of the grouped problem belongs to expert e where
offsets[e] <= i < offsets[e + 1], and is multiplied by weight[e] ([E, N, K], the layout of
transformers' fused `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]). Each output element is
computed exactly as the plain canonical matmul computes it (kernels/triton/matmul.py): the K loop is
matmul.py's own `_segment_sum` with one segment (fp32 accumulator, one tensor-core dot per BLOCK_K
K-elements from k = 0, the K tail masked to zero), then one rounding to bf16. So a row's bits equal
`kernels.matmul(row, weight[e])`, whatever the other rows of its expert or of the batch.

Nothing here reads device values on the host: each program finds its row tile from the expert offsets
on the device, and the grid is sized by the most tiles any routing can need (programs past the real
tiles return at once), so a whole MoE layer can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .matmul import BLOCK_K, _segment_sum


@dataclass(frozen=True)
class GroupedConfig:
    """Launch configuration; none of these fields changes the numbers (BLOCK_K is fixed)."""
    block_m: int
    block_n: int  # accumulator columns; with the fused SiLU half are gate columns, half up columns
    warps: int
    stages: int


# Rows per expert on average pick the tiles: few rows stream the weights with narrow row tiles.
# Each row: (max average rows per expert, fused gate_up + SiLU config, plain config). Measured on an
# H100 for Qwen3-30B-A3B's layer (bench/moe_layer.py --sweep; 128 experts, top-8: 16 / 64 / 256 rows
# per expert at 256 / 1024 / 4096 tokens).
_TABLE = [
    (8, GroupedConfig(16, 128, 4, 4), GroupedConfig(16, 128, 4, 4)),
    (32, GroupedConfig(32, 128, 8, 4), GroupedConfig(32, 128, 4, 4)),
    (96, GroupedConfig(64, 128, 8, 4), GroupedConfig(32, 256, 4, 4)),
    (None, GroupedConfig(128, 256, 8, 4), GroupedConfig(128, 256, 8, 4)),
]


@functools.lru_cache(maxsize=1024)
def pick_config(num_rows: int, num_experts: int, silu: bool = False) -> GroupedConfig:
    """A function of the shapes only (never of the routing, which lives on the device)."""
    avg = num_rows / max(num_experts, 1)
    for max_avg, fused, plain in _TABLE:
        if max_avg is None or avg <= max_avg:
            return fused if silu else plain
    raise AssertionError("the table ends with a catch-all row")


def max_row_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Row tiles of any routing: expert e with c_e rows has cdiv(c_e, block_m) tiles, so at most
    cdiv(num_rows, block_m) + (experts with work) <= cdiv(num_rows, block_m) + min(E, num_rows)."""
    return triton.cdiv(num_rows, block_m) + min(num_experts, num_rows)


@triton.jit
def _row_tile(tile, offsets_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of row tile number `tile`, experts in order; each program reads the
    E + 1 offsets itself (no tile table to build). Past the last tile, expert >= num_experts."""
    eo = tl.arange(0, BLOCK_E)
    ok = eo < num_experts
    lo = tl.load(offsets_ptr + eo, mask=ok, other=0).to(tl.int32)
    hi = tl.load(offsets_ptr + eo + 1, mask=ok, other=0).to(tl.int32)
    tiles = (hi - lo + (BLOCK_M - 1)) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    e = tl.sum((ends <= tile).to(tl.int32), 0)
    mine = eo == e
    first = tl.sum(tl.where(mine, lo + (tile - (ends - tiles)) * BLOCK_M, 0), 0)
    end = tl.sum(tl.where(mine, hi, 0), 0)
    return e, first, end


@triton.jit
def _silu_mul(gate, up):
    """bf16(silu(g) * u) of bf16-valued fp32 tiles: the formula of elementwise.py's _silu_mul_kernel."""
    sig = tl.math.div_rn(tl.zeros_like(gate) + 1.0, tl.exp(-gate) + 1.0)
    return (gate * sig * up).to(tl.bfloat16)


@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, out_ptr, src_ptr, dst_ptr, offsets_ptr, num_experts, N, K, n_tiles,
                       stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                       GATHER: tl.constexpr, SCATTER: tl.constexpr, SILU: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """One (row tile, column tile) of the grouped product.

    GATHER: grouped row i reads x[src[i]] (token rows are not copied). SCATTER: it is written to
    out[dst[i]]. SILU: the weight's rows are [gate; up] (N = 2 * half); the tile's columns are gate
    columns c and up columns half + c, and out[:, c] = silu_mul(bf16(gate), bf16(up))."""
    pid = tl.program_id(0)
    tile = pid // n_tiles
    pid_n = pid % n_tiles
    e, row0, row_end = _row_tile(tile, offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    if e >= num_experts:  # past the real tiles (the grid is sized for any routing)
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < row_end
    # rows past the expert's last read its first row instead (results discarded, as in _mm_kernel)
    ld_m = tl.where(m_ok, offs_m, row0)
    if GATHER:
        a_rows = tl.load(src_ptr + ld_m).to(tl.int64)
    else:
        a_rows = ld_m.to(tl.int64)
    if SILU:
        HALF_N: tl.constexpr = BLOCK_N // 2
        half = N // 2
        c = tl.arange(0, BLOCK_N)
        col = pid_n * HALF_N + c % HALF_N
        n_ok = col < half
        w_rows = (tl.where(n_ok, col, 0) + (c // HALF_N) * half).to(tl.int64)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    # the canonical K loop itself: one segment [0, K), BLOCK_K tiles in order
    acc = _segment_sum(x_ptr, w_e, a_rows, w_rows, 0, K, K, stride_xm, stride_xk, stride_wn, stride_wk,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    if SCATTER:
        o_rows = tl.load(dst_ptr + ld_m).to(tl.int64)
    else:
        o_rows = offs_m.to(tl.int64)
    if SILU:
        pair = tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF_N)), (0, 2, 1))
        gate, up = tl.split(pair)
        # round each product to bf16 first, as the plain path stores gate_up before silu_mul reads it
        val = _silu_mul(gate.to(tl.bfloat16).to(tl.float32), up.to(tl.bfloat16).to(tl.float32))
        offs_o = pid_n * HALF_N + tl.arange(0, HALF_N)
        o_mask = m_ok[:, None] & (offs_o < half)[None, :]
    else:
        val = acc.to(out_ptr.dtype.element_ty)
        offs_o = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o_mask = m_ok[:, None] & (offs_o < N)[None, :]
    tl.store(out_ptr + o_rows[:, None] * stride_om + offs_o[None, :] * stride_on, val, mask=o_mask)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                   src: torch.Tensor | None = None, dst: torch.Tensor | None = None, silu: bool = False,
                   config: GroupedConfig | None = None) -> torch.Tensor:
    """Grouped canonical x @ weight[e].T, bf16 out.

    x [R, K] bf16; weight [E, N, K] bf16; offsets [E + 1] (device): grouped row i belongs to expert e
    for offsets[e] <= i < offsets[e + 1]. src [S]: grouped row i is x[src[i]] (default: x's row i,
    S = R). dst [S]: grouped row i is written to output row dst[i] (a permutation of 0..S-1; default i).
    silu: weight holds [gate; up] (N = 2I) and the result is [S, I] = silu_mul(gate, up), as
    kernels.silu_mul of the two bf16 halves. config: a forced launch configuration (same numbers)."""
    num_experts, n_dim, k_dim = weight.shape
    if x.shape[-1] != k_dim:
        raise ValueError(f"x has K={x.shape[-1]} but weight is {tuple(weight.shape)} ([E, N, K])")
    if offsets.shape != (num_experts + 1,):
        raise ValueError(f"offsets must have E + 1 = {num_experts + 1} entries, got {tuple(offsets.shape)}")
    if silu and n_dim % 2:
        raise ValueError(f"silu needs [gate; up] weights (even N), got N={n_dim}")
    num_rows = src.shape[0] if src is not None else x.shape[0]
    n_out = n_dim // 2 if silu else n_dim
    out = torch.empty(num_rows, n_out, dtype=torch.bfloat16, device=x.device)
    if num_rows == 0:
        return out
    cfg = config or pick_config(num_rows, num_experts, silu)
    n_tiles = triton.cdiv(n_out, cfg.block_n // 2 if silu else cfg.block_n)
    grid = (max_row_tiles(num_rows, num_experts, cfg.block_m) * n_tiles,)
    _grouped_mm_kernel[grid](
        x, weight, out, src if src is not None else offsets, dst if dst is not None else offsets, offsets,
        num_experts, n_dim, k_dim, n_tiles,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out.stride(1),
        GATHER=src is not None, SCATTER=dst is not None, SILU=silu, EVEN_K=k_dim % BLOCK_K == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)), num_warps=cfg.warps, num_stages=cfg.stages)
    return out


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, stride_y, stride_o, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = bf16(sum over j = 0..k-1, in order, of float(y[t*k + j]) * w[t, j]), fp32 throughout."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    first = t * TOP_K
    acc = tl.load(y_ptr + first * stride_y + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(w_ptr + first)
    for j in tl.static_range(1, TOP_K):
        y = tl.load(y_ptr + (first + j) * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        acc = acc + y * tl.load(w_ptr + first + j)
    tl.store(out_ptr + t * stride_o + cols, acc.to(tl.bfloat16), mask=mask)


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """bf16 [T, H]: per token, the fp32 sum in slot order of float(y) * weight.

    y [T * k, H] bf16 (row t * k + j: the token's j-th expert, experts in increasing id order);
    weights [T, k] fp32. The same bits as the torch formula (each product and sum rounded on its own:
    compiled without FMA contraction)."""
    num_tokens, top_k = weights.shape
    hidden = y.shape[-1]
    if y.shape[0] != num_tokens * top_k:
        raise ValueError(f"y has {y.shape[0]} rows, expected T * k = {num_tokens * top_k}")
    w = weights.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=y.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](y, w, out, hidden, y.stride(0), out.stride(0),
                                                             TOP_K=top_k, BLOCK=block, num_warps=4,
                                                             enable_fp_fusion=False)
    return out


__all__ = ["GroupedConfig", "combine", "grouped_matmul", "max_row_tiles", "pick_config"]
