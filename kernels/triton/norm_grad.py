"""RMSNorm's gradients in one launch: the trainer's backward, not a canonical op.

The backward of rms_norm_ref (kernels/backward.py): y = w * bf16(x * r), r = rsqrt(mean(x^2) + eps). In torch it
is about a dozen passes over float32 copies of [rows, H] per norm, four norms a layer in Qwen3 (the layer's two and
the per-head q and k norms), which made the norms' backward a fifth of a 4B train step. Here each program takes a
slab of rows, reads x and the incoming gradient once, writes x's gradient (plus a residual gradient, for add +
norm) and one float32 partial of the weight's gradient; torch sums the partials. Gradients need no fixed bits
(kernels/backward.py), so the sums may run in any order; each rounding to bf16 that autograd's formula has is kept.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import current_sms

_PROGRAMS_PER_SM = 4


@triton.jit
def _rms_norm_grad_kernel(x_ptr, g_ptr, w_ptr, res_ptr, gx_ptr, gw_ptr, rows, H, rows_per_program, eps,
                          stride_x, stride_g, stride_r, stride_gx, WANT_X: tl.constexpr, WANT_W: tl.constexpr,
                          HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    partial = tl.zeros([BLOCK], tl.float32)
    first = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        if row < rows:
            row64 = row.to(tl.int64)
            x = tl.load(x_ptr + row64 * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row64 * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
            if WANT_W:
                partial += g * (x * r).to(tl.bfloat16).to(tl.float32)
            if WANT_X:
                # the rounding of x * r to bf16 passes the gradient through in bf16, as autograd's does
                gn = (g * w).to(tl.bfloat16).to(tl.float32)
                dot = tl.sum(gn * x, axis=0)
                gx = (gn * r - x * (r * r * r * dot / H)).to(gx_ptr.dtype.element_ty)
                if HAS_RES:  # autograd's sum of the residual's gradient and the norm's, in x's dtype
                    res = tl.load(res_ptr + row64 * stride_r + cols, mask=inside, other=0.0)
                    res = res.to(gx_ptr.dtype.element_ty).to(tl.float32)
                    gx = (gx.to(tl.float32) + res).to(gx_ptr.dtype.element_ty)
                tl.store(gx_ptr + row64 * stride_gx + cols, gx, mask=inside)
    if WANT_W:
        tl.store(gw_ptr + pid.to(tl.int64) * H + cols, partial, mask=inside)


def rms_norm_grads(x: torch.Tensor, weight: torch.Tensor, eps: float, grad_out: torch.Tensor, want_x: bool,
                   want_w: bool, residual_grad: torch.Tensor | None = None):
    """(grad x, grad weight) of rms_norm_ref at x [..., H] (None where not wanted); residual_grad: a gradient
    of x's from elsewhere, added to grad x in x's dtype."""
    H = x.shape[-1]
    if weight.shape != (H,) or grad_out.shape != x.shape:
        raise ValueError(f"rms_norm_grads needs x [..., H], weight [H] and a gradient shaped as x: x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}, gradient {tuple(grad_out.shape)}")
    x2, g2 = x.reshape(-1, H), grad_out.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    rows = x2.shape[0]
    gx = torch.empty((rows, H), dtype=x.dtype, device=x.device) if want_x else None
    res = None
    if want_x and residual_grad is not None:
        res = residual_grad.reshape(-1, H)
        res = res if res.stride(-1) == 1 else res.contiguous()
    programs = max(1, min(rows, _PROGRAMS_PER_SM * current_sms()))
    per_program = -(-rows // programs) if rows else 0
    programs = -(-rows // per_program) if rows else 1
    partials = torch.zeros((programs, H), dtype=torch.float32, device=x.device) if want_w else None
    if rows and (want_x or want_w):
        _rms_norm_grad_kernel[(programs,)](
            x2, g2, weight, res if res is not None else x2, gx if gx is not None else x2,
            partials if partials is not None else x2, rows, H, per_program, float(eps), x2.stride(0), g2.stride(0),
            res.stride(0) if res is not None else 0, H, WANT_X=want_x, WANT_W=want_w, HAS_RES=res is not None,
            BLOCK=triton.next_power_of_2(H), num_warps=4 if H <= 1024 else 8)
    grad_x = gx.view(x.shape) if gx is not None else None
    grad_w = partials.sum(0).to(weight.dtype) if partials is not None else None
    return grad_x, grad_w
