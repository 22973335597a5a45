"""Canonical forward, ordinary backward.

Only the forward numbers must match the rollout engine; gradients come from the standard formula of
each op (evaluated at the same inputs), which is what the unpatched model would compute.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


class _CanonicalForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, canonical: Callable, reference: Callable, *inputs):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return canonical(*inputs)

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad_out.to(out.dtype), allow_unused=True))
        return (None, None, *[next(grads) if t.requires_grad else None for t in inputs])


def with_reference_grad(canonical: Callable, reference: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    """canonical(*inputs), differentiable through reference(*inputs) when grad is needed."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _CanonicalForward.apply(canonical, reference, *inputs)
    return canonical(*inputs)


def linear_ref(x, weight, bias=None, out_dtype=torch.bfloat16):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(out_dtype)


def rms_norm_ref(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y.to(torch.bfloat16).float()).to(torch.bfloat16)


def silu_mul_ref(gate, up):
    return (F.silu(gate.float()) * up.float()).to(torch.bfloat16)


def attention_ref(q, k, v, positions, scale):
    """Causal attention over contiguous KV (training shapes) with torch's own math."""
    groups = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(groups, dim=2)
    vf = v.float().repeat_interleave(groups, dim=2)
    scores = torch.einsum("bthd,blhd->bhtl", q.float(), kf) * scale
    key_pos = torch.arange(k.shape[1], device=q.device)
    visible = key_pos[None, None, None, :] <= positions[:, None, :, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhtl,blhd->bthd", probs, vf).to(torch.bfloat16)
