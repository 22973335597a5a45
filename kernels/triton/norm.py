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


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, M, N, n_float, stride_xm, stride_om, eps,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    var = tl.math.div_rn(tl.sum(x * x, axis=1), tl.zeros([ROWS], dtype=tl.float32) + n_float)
    inv = tl.math.div_rn(tl.zeros_like(var) + 1.0, tl.sqrt_rn(var + eps))  # correctly rounded, as the reference
    y = (x * inv[:, None]).to(tl.bfloat16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], (w[None, :] * y).to(tl.bfloat16), mask=mask)


@functools.lru_cache(maxsize=None)
def _layout(n: int):
    block = max(16, triton.next_power_of_2(n))
    rows = max(1, 2048 // block)  # short rows (q/k norm over head_dim) share a program
    warps = 4 if block * rows <= 4096 else (8 if block <= 8192 else 16)
    return rows, block, warps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = bf16(x / sqrt(mean(x^2) + eps)); out = bf16(weight * y), fp32 math; x [..., N] bf16."""
    n = x.shape[-1]
    if n > 65536:
        raise ValueError(f"rms_norm supports rows up to 65536 elements, got {n}")
    x2 = x.reshape(-1, n)
    weight = weight.contiguous()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    rows, block, warps = _layout(n)
    _rms_norm_kernel[(triton.cdiv(m, rows),)](x2, weight, out, m, n, float(n), x2.stride(0), out.stride(0), float(eps),
                                              ROWS=rows, BLOCK=block, num_warps=warps)
    return out.reshape(x.shape)
