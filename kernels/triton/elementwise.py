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
