"""Canonical forward, ordinary backward.

Only the forward numbers must match the rollout engine; gradients come from the standard formula of
each op (evaluated at the same inputs), computed the way the unpatched bf16 model computes them:
linear layers by bf16 GEMMs (cuBLAS on CUDA), attention by scaled_dot_product_attention's backward
(flash on CUDA), the elementwise ops by autograd through their plain-torch formulas.
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


class _CanonicalLinear(torch.autograd.Function):
    """Canonical x @ weight.T (+ bias); F.linear's backward in the inputs' dtype (no forward recompute)."""

    @staticmethod
    def forward(ctx, canonical: Callable, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return canonical(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.to(x.dtype)
        g2 = g.reshape(-1, g.shape[-1])
        grad_x = g @ weight if ctx.needs_input_grad[1] else None
        grad_w = g2.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[2] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, grad_x, grad_w, grad_b


def linear_with_grad(canonical: Callable, x, weight, bias=None):
    """canonical(x, weight, bias), differentiable by the ordinary linear backward when grad is needed."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _CanonicalLinear.apply(canonical, x, weight, bias)
    return canonical(x, weight, bias)


def rms_norm_ref(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y.to(torch.bfloat16).float()).to(torch.bfloat16)


def silu_mul_ref(gate, up):
    """The unpatched MLP's act_fn(gate) * up, in the inputs' dtype."""
    return F.silu(gate) * up


class _CanonicalAdd(torch.autograd.Function):
    """Canonical a + b; the gradient passes to both unchanged (nothing to recompute)."""

    @staticmethod
    def forward(ctx, canonical: Callable, a, b):
        ctx.dtypes = a.dtype, b.dtype
        return canonical(a, b)

    @staticmethod
    def backward(ctx, grad_out):
        return None, grad_out.to(ctx.dtypes[0]), grad_out.to(ctx.dtypes[1])


def add_with_grad(canonical: Callable, a, b):
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _CanonicalAdd.apply(canonical, a, b)
    return canonical(a, b)


def attention_ref(q, k, v, positions, scale):
    """Causal GQA attention over contiguous KV (training shapes) by scaled_dot_product_attention, for
    its backward. q [B, T, Hq, D]; query (b, t) sees keys 0..positions[b, t]."""
    groups = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(groups, dim=2),
                                              v.repeat_interleave(groups, dim=2)))
    t_q, t_k = q.shape[1], k.shape[1]
    key_pos = torch.arange(t_k, device=q.device)
    if t_q == t_k and bool((positions == key_pos[:t_q]).all()):  # a whole sequence from 0: the causal kernel
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:  # padding rows (negative positions) see key 0 only: no empty softmax (their gradient is zero)
        visible = (key_pos[None, None, :] <= positions[:, :, None].clamp_min(0))[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible, scale=scale)
    return out.transpose(1, 2)
