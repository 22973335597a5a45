"""Ordinary (non-canonical) ops for the native fast path: whatever is fastest on the device.

On CUDA the GEMMs are cuBLAS and decode attention is split-KV (their reduction order follows the
batch); the elementwise ops reuse the canonical kernels, which are as fast as torch's and keep the
fast path's numbers close to the verifier's (fewer rejected proposals).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels as K
from kernels.forward import OpSet
from kernels.reference.ops import gather_kv


def _linear(x, w, b=None, row_parallel=False):
    return F.linear(x, w, b)


def _logits(x, w):
    if x.is_cuda:  # fp32 out of the GEMM, like the verifier's logits (rounding them to bf16 flips picks)
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).reshape(*x.shape[:-1], -1)
    return F.linear(x, w).float()


def _rms_norm(x, w, eps):
    if x.is_cuda:  # elementwise ops: the canonical kernels (same formula as the verifier, and fast)
        return K.rms_norm(x, w, eps)
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _attention(q, k, v, positions, block_table=None, scale=None):
    """CUDA: split-KV decode kernel over the paged cache (one token per sequence), else the canonical
    kernel; both are free of host syncs, so decode steps can be CUDA-graphed. CPU: masked SDPA."""
    if q.is_cuda:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if block_table is not None and q.shape[1] == 1:
            from rollout_service.engine.fast_path.decode_attention import decode_attention
            return decode_attention(q, k, v, positions, block_table, scale)
        return K.attention(q, k, v, positions, block_table=block_table, scale=scale)
    return _sdpa_attention(q, k, v, positions, block_table, scale)


def _sdpa_attention(q, k, v, positions, block_table=None, scale=None):
    """Masked SDPA over the gathered paged cache."""
    n_keys = int(positions.max().item()) + 1
    if block_table is not None:
        nb = -(-n_keys // k.shape[1])
        k, v = gather_kv(k, block_table, nb), gather_kv(v, block_table, nb)
    k, v = k[:, :n_keys].transpose(1, 2), v[:, :n_keys].transpose(1, 2)  # [B, Hkv, L, D]
    groups = q.shape[2] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    visible = torch.arange(n_keys, device=q.device)[None, None, :] <= positions[:, :, None]  # [B, T, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=scale)
    return torch.where((positions >= 0)[..., None, None], out.transpose(1, 2), 0).to(q.dtype)


def _silu_mul(gate, up):
    if gate.is_cuda:
        return K.silu_mul(gate, up)
    return F.silu(gate) * up


def _add(a, b):
    if a.is_cuda:
        return K.add(a, b)
    return a + b


def _rotary(x, cos, sin):
    if x.is_cuda:
        return K.rotary(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _add_rms_norm(a, b, w, eps):
    if a.is_cuda:
        return K.add_rms_norm(a, b, w, eps)
    s = a + b
    return s, _rms_norm(s, w, eps)


def _rotary_qk(q, k, cos, sin):
    if q.is_cuda:
        return K.rotary_qk(q, k, cos, sin)
    return _rotary(q, cos, sin), _rotary(k, cos, sin)


FAST_OPS = OpSet(name="fast", linear=_linear, logits=_logits, rms_norm=_rms_norm, attention=_attention,
                 silu_mul=_silu_mul, add=_add, rotary=_rotary, fused_add_rms_norm=_add_rms_norm,
                 fused_rotary_qk=_rotary_qk, log_softmax=lambda x: torch.log_softmax(x, dim=-1),
                 grouped_experts=True)  # MoE: the grouped kernels beat a host-synced loop, and graph
