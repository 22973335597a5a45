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


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with unit stride along the row (a view where it can be)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g2, u2 = rows_2d(gate), rows_2d(up)
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
def _rotate_heads(x_ptr, cos_ptr, sin_ptr, out_ptr, row, H, stride_xr, stride_xh, stride_cr, stride_sr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's H heads, rotated into a contiguous [H, 2 * HALF] output row."""
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
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xr, stride_xh, stride_cr, stride_sr,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    _rotate_heads(x_ptr, cos_ptr, sin_ptr, out_ptr, tl.program_id(0).to(tl.int64), H, stride_xr, stride_xh,
                  stride_cr, stride_sr, HALF, BLOCK_H, BLOCK_D)


@triton.jit
def _rotary_qk_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, HQ, HK, stride_qr, stride_qh,
                      stride_kr, stride_kh, stride_cr, stride_sr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                      BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """program_id(1): 0 rotates the token's query heads, 1 its key heads (one launch for both)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate_heads(q_ptr, cos_ptr, sin_ptr, qo_ptr, row, HQ, stride_qr, stride_qh, stride_cr, stride_sr,
                      HALF, BLOCK_HQ, BLOCK_D)
    else:
        _rotate_heads(k_ptr, cos_ptr, sin_ptr, ko_ptr, row, HK, stride_kr, stride_kh, stride_cr, stride_sr,
                      HALF, BLOCK_HK, BLOCK_D)


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (a + b).to(tl.bfloat16), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def _lora_add_kernel(base_ptr, prod_ptr, mask_ptr, out_ptr, rows, N, scale, stride_b, stride_p,
                     HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    base = tl.load(base_ptr + row * stride_b + cols, mask=inside, other=0.0)
    prod = tl.load(prod_ptr + row * stride_p + cols, mask=inside, other=0.0).to(tl.float32)
    delta = (prod * scale).to(tl.bfloat16)  # torch.mul(bf16, float): in fp32, rounded to bf16
    added = (base.to(tl.float32) + delta.to(tl.float32)).to(tl.bfloat16)
    if HAS_MASK:
        keep = tl.load(mask_ptr + row) != 0
        added = tl.where(keep, added, base)
    tl.store(out_ptr + row * N + cols, added, mask=inside)


def lora_add(base: torch.Tensor, product: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """kernels.reference.lora_add in one pass over the rows (the scale, the add and the select fused): reads
    base and product once and writes once, where the three ops read and write [rows, N] five and three times."""
    if base.shape != product.shape or (mask is not None and tuple(mask.shape) != tuple(base.shape[:-1])):
        raise ValueError(f"lora_add: base {tuple(base.shape)}, product {tuple(product.shape)} and mask "
                         f"{None if mask is None else tuple(mask.shape)} ([..., N], [..., N], [...])")
    b2, p2 = rows_2d(base), rows_2d(product)
    rows, n = b2.shape
    out = torch.empty(base.shape, dtype=torch.bfloat16, device=base.device)
    m1 = b2 if mask is None else mask.reshape(-1).contiguous()  # any pointer when there is no mask
    block = min(2048, max(16, triton.next_power_of_2(n)))
    _lora_add_kernel[(rows, triton.cdiv(n, block))](b2, p2, m1, out, rows, n, float(scale), b2.stride(0),
                                                    p2.stride(0), HAS_MASK=mask is not None, BLOCK=block,
                                                    num_warps=4, **_NO_FMA)
    return out


def _token_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] as [B * T, H, D] with unit stride along D (a view of a fused projection where it can)."""
    b, t, h, d = x.shape
    x3 = x.reshape(b * t, h, d)
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def _rotary_rows(cos: torch.Tensor, sin: torch.Tensor,
                 tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rows_2d(cos.reshape(tokens, -1).float()), rows_2d(sin.reshape(tokens, -1).float())


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, T, H, D] bf16, cos/sin [B, T, D/2] fp32 (as kernels.reference.rotary)."""
    b, t, h, d = x.shape
    x3 = _token_heads(x)
    c2, s2 = _rotary_rows(cos, sin, b * t)
    out = torch.empty(b, t, h, d, dtype=torch.bfloat16, device=x.device)
    half = d // 2
    _rotary_kernel[(b * t,)](x3, c2, s2, out, h, x3.stride(0), x3.stride(1), c2.stride(0), s2.stride(0),
                             HALF=half, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(half),
                             num_warps=4, **_NO_FMA)
    return out


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary(q), rotary(k)) in one launch; q [B, T, Hq, D], k [B, T, Hkv, D]."""
    b, t, hq, d = q.shape
    hk = k.shape[2]
    q3, k3 = _token_heads(q), _token_heads(k)
    c2, s2 = _rotary_rows(cos, sin, b * t)
    q_out = torch.empty(b, t, hq, d, dtype=torch.bfloat16, device=q.device)
    k_out = torch.empty(b, t, hk, d, dtype=torch.bfloat16, device=k.device)
    half = d // 2
    _rotary_qk_kernel[(b * t, 2)](q3, k3, c2, s2, q_out, k_out, hq, hk, q3.stride(0), q3.stride(1), k3.stride(0),
                                  k3.stride(1), c2.stride(0), s2.stride(0), HALF=half,
                                  BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
                                  BLOCK_D=triton.next_power_of_2(half), num_warps=4, **_NO_FMA)
    return q_out, k_out


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16(float(a) + float(b)), elementwise."""
    if a.shape != b.shape:
        return (a.float() + b.float()).to(torch.bfloat16)  # broadcasting: the reference formula
    a1, b1 = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    out = torch.empty(a.shape, dtype=torch.bfloat16, device=a.device)
    block = 1024
    _add_kernel[(triton.cdiv(a1.numel(), block),)](a1, b1, out, a1.numel(), BLOCK=block, num_warps=4, **_NO_FMA)
    return out
