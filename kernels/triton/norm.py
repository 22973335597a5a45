"""Canonical RMSNorm: each row reduced in one fixed order that depends only on the row length.

ROWS rows share a program as a [ROWS, BLOCK] tile; ROWS, BLOCK and num_warps are functions of N alone,
so every row of a given length is reduced by the same sequence of operations wherever it sits and
however many rows there are.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .elementwise import rows_2d


@triton.jit
def _row_tile(M, N, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's [ROWS, BLOCK] tile: row indices (int64), columns, column mask, element mask."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    return rows.to(tl.int64), cols, cmask, (rows < M)[:, None] & cmask[None, :]


@triton.jit
def _normalize_rows(x, w_ptr, cols, cmask, n_float, eps, ROWS: tl.constexpr):
    """bf16(w * bf16(x / sqrt(mean(x^2) + eps))) for an fp32 [ROWS, BLOCK] tile (zeros past N)."""
    var = tl.math.div_rn(tl.sum(x * x, axis=1), tl.zeros([ROWS], dtype=tl.float32) + n_float)
    inv = tl.math.div_rn(tl.zeros_like(var) + 1.0, tl.sqrt_rn(var + eps))  # correctly rounded, as the reference
    y = (x * inv[:, None]).to(tl.bfloat16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    return (w[None, :] * y).to(tl.bfloat16)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, M, N, n_float, stride_xm, stride_om, eps,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows64, cols, cmask, mask = _row_tile(M, N, ROWS, BLOCK)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _normalize_rows(x, w_ptr, cols, cmask, n_float, eps, ROWS)
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], y, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _add_rms_norm_kernel(a_ptr, b_ptr, w_ptr, sum_ptr, out_ptr, M, N, n_float, stride_am, stride_bm, stride_om,
                         eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """sum = bf16(a + b) (the residual add), out = rms_norm(sum): the two kernels' numbers in one pass."""
    rows64, cols, cmask, mask = _row_tile(M, N, ROWS, BLOCK)
    a = tl.load(a_ptr + rows64[:, None] * stride_am + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows64[:, None] * stride_bm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = (a + b).to(tl.bfloat16)
    dst = rows64[:, None] * stride_om + cols[None, :]
    tl.store(sum_ptr + dst, s, mask=mask)
    tl.store(out_ptr + dst, _normalize_rows(s.to(tl.float32), w_ptr, cols, cmask, n_float, eps, ROWS), mask=mask)


@functools.lru_cache(maxsize=None)
def _layout(n: int):
    block = max(16, triton.next_power_of_2(n))
    rows = max(1, 2048 // block)  # short rows (q/k norm over head_dim) share a program
    warps = 4 if block * rows <= 4096 else (8 if block <= 8192 else 16)
    return rows, block, warps


def _check_row_length(n: int) -> None:
    if n > 65536:
        raise ValueError(f"rms_norm supports rows up to 65536 elements, got {n}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = bf16(x / sqrt(mean(x^2) + eps)); out = bf16(weight * y), fp32 math; x [..., N] bf16."""
    n = x.shape[-1]
    _check_row_length(n)
    x2 = rows_2d(x)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    rows, block, warps = _layout(n)
    _rms_norm_kernel[(triton.cdiv(m, rows),)](x2, weight.contiguous(), out, m, n, float(n), x2.stride(0),
                                              out.stride(0), float(eps), ROWS=rows, BLOCK=block, num_warps=warps)
    return out.reshape(x.shape)


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = bf16(a + b): elementwise.add then rms_norm, bit for bit, in one launch
    (same row layout as rms_norm, so each row is reduced in the same order)."""
    n = a.shape[-1]
    _check_row_length(n)
    a2, b2 = rows_2d(a), rows_2d(b)
    m = a2.shape[0]
    s = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    out = torch.empty_like(s)
    rows, block, warps = _layout(n)
    _add_rms_norm_kernel[(triton.cdiv(m, rows),)](a2, b2, weight.contiguous(), s, out, m, n, float(n), a2.stride(0),
                                                  b2.stride(0), out.stride(0), float(eps), ROWS=rows, BLOCK=block,
                                                  num_warps=warps)
    return s.reshape(a.shape), out.reshape(a.shape)
