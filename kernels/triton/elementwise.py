"""Canonical SiLU-gated product: bf16(silu(g) * u) in fp32, elementwise (invariant by construction)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, M, N, stride_gm, stride_um, stride_om, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * stride_gm + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_um + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.math.div_rn(tl.zeros_like(g) + 1.0, tl.exp(-g) + 1.0)
    tl.store(out_ptr + row * stride_om + cols, (g * sig * u).to(tl.bfloat16), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g2, u2 = _rows(gate), _rows(up)
    m, n = g2.shape
    out = torch.empty(m, n, dtype=torch.bfloat16, device=gate.device)
    block = min(2048, max(16, triton.next_power_of_2(n)))
    _silu_mul_kernel[(m, triton.cdiv(n, block))](g2, u2, out, m, n, g2.stride(0), u2.stride(0), out.stride(0),
                                                 BLOCK=block, num_warps=4)
    return out.reshape(gate.shape)


# Rotary and add: the reference's fp32 formulas, launched without FP contraction (no FMA), so each
# output is the same bits as kernels.reference on the same device; one launch instead of ~10 torch ops.
_NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xr, stride_xh, stride_cr, stride_sr,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    mask = (h < H)[:, None] & dmask[None, :]
    src = x_ptr + row * stride_xr + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + row * stride_cr + d, mask=dmask, other=0.0)[None, :]
    s = tl.load(sin_ptr + row * stride_sr + d, mask=dmask, other=0.0)[None, :]
    dst = out_ptr + row * (H * 2 * HALF) + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(tl.bfloat16), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(tl.bfloat16), mask=mask)


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (a + b).to(tl.bfloat16), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, T, H, D] bf16, cos/sin [B, T, D/2] fp32 (as kernels.reference.rotary)."""
    b, t, h, d = x.shape
    x3 = x.reshape(b * t, h, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    c2, s2 = cos.reshape(b * t, -1).float(), sin.reshape(b * t, -1).float()
    c2 = c2 if c2.stride(-1) == 1 else c2.contiguous()
    s2 = s2 if s2.stride(-1) == 1 else s2.contiguous()
    out = torch.empty(b, t, h, d, dtype=torch.bfloat16, device=x.device)
    half = d // 2
    _rotary_kernel[(b * t,)](x3, c2, s2, out, h, x3.stride(0), x3.stride(1), c2.stride(0), s2.stride(0),
                             HALF=half, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(half),
                             num_warps=4, **_NO_FMA)
    return out


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16(float(a) + float(b)), elementwise."""
    if a.shape != b.shape:
        return (a.float() + b.float()).to(torch.bfloat16)  # broadcasting: the reference formula
    a1, b1 = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    out = torch.empty(a.shape, dtype=torch.bfloat16, device=a.device)
    block = 1024
    _add_kernel[(triton.cdiv(a1.numel(), block),)](a1, b1, out, a1.numel(), BLOCK=block, num_warps=4, **_NO_FMA)
    return out
