"""Canonical ops: numbers that depend only on a row's own inputs, never on batch, chunking or layout.

Each public op dispatches on the device of its inputs: CUDA tensors use the Triton kernels when they
are installed (kernels.triton), everything else the reference implementation (kernels.reference).
Ops are differentiable: canonical forward, ordinary backward (kernels.backward).
"""
from __future__ import annotations

import torch

from . import reference
from .backend import backend_for, canonical_config, kernel_family
from .backward import (add_rms_norm_with_grad, add_with_grad, attention_with_grad, linear_with_grad, lora_add_with_grad,
                       rms_norm_with_grad, rotary_qk_with_grad, rotary_with_grad, silu_mul_with_grad)
from .contract import (KERNELS_VERSION as __version__, TREE_SEGMENTS_ENV, TREE_WIDTHS, CanonicalConfig,
                       CanonicalMismatchError, check_canonical, set_tree_segments, tree_segments)
from .packed_attention import PackedRow, packed_attention_with_grad
from .logprobs import (head_token_logprobs, log_softmax, logprob_temperature, mask_vocab_tail, scale_logits,
                       token_logprobs)
from .lora import per_member
from .sampling import gumbel_noise, sample, sampling_position, sampling_positions


def _check(name: str, t: torch.Tensor, dims: int | None = None, dtype: torch.dtype | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")


def _check_lora_mask(base: torch.Tensor, mask: torch.Tensor | None) -> None:
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != tuple(base.shape[:-1])):
        raise ValueError(f"lora_add's mask must be bool of shape {tuple(base.shape[:-1])}, got {mask.dtype} "
                         f"{tuple(mask.shape)}")


def _same_device(*ts):
    devices = {t.device for t in ts if t is not None}
    if len(devices) > 1:
        raise ValueError(f"inputs are on different devices: {sorted(map(str, devices))}")


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           row_parallel: bool = False, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Canonical x @ weight.T (+ bias); bf16 inputs, fp32 accumulation in a fixed K order.

    row_parallel=True uses the segment tree over K (tree_segments() segments), so any TP degree that
    divides tree_segments() reproduces it exactly.
    """
    _check("x", x, dtype=torch.bfloat16)
    _check("weight", weight, dims=2, dtype=torch.bfloat16)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has K={x.shape[-1]} but weight is {tuple(weight.shape)} ([N, K])")
    _same_device(x, weight, bias)
    segments = tree_segments() if row_parallel else 1
    impl = backend_for(x).matmul
    return linear_with_grad(lambda x_, w_, b_: impl(x_, w_, b_, segments=segments, out_dtype=out_dtype),
                            x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check("x", x, dtype=torch.bfloat16)
    _check("weight", weight, dims=1, dtype=torch.bfloat16)
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x last dim {x.shape[-1]} != weight size {weight.shape[0]}")
    _same_device(x, weight)
    impl = backend_for(x).rms_norm
    return rms_norm_with_grad(lambda a, w: impl(a, w, eps), x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check("gate", gate, dtype=torch.bfloat16)
    _check("up", up, dtype=torch.bfloat16)
    return silu_mul_with_grad(backend_for(gate).silu_mul, gate, up)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, elementwise in fp32 (canonical by construction); x [B, T, H, D] bf16."""
    return rotary_with_grad(backend_for(x).rotary, x, cos, sin)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16(float(a) + float(b)): the residual add."""
    if a.shape != b.shape:
        raise ValueError(f"add takes equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    return add_with_grad(backend_for(a).add, a, b)


def lora_add(base: torch.Tensor, product: torch.Tensor, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """A LoRA term's epilogue (kernels.lora): add(base, bf16(product * scale)) on the rows of mask [...] (every row
    if None), base itself elsewhere; base and product [..., N] bf16. One pass on GPU, the same bits as the
    mul, add and select it replaces."""
    _check("base", base, dtype=torch.bfloat16)
    _check("product", product, dtype=torch.bfloat16)
    if base.shape != product.shape:
        raise ValueError(f"lora_add takes equal shapes, got {tuple(base.shape)} and {tuple(product.shape)}")
    _check_lora_mask(base, mask)
    _same_device(base, product, mask)
    return lora_add_with_grad(backend_for(base).lora_add, base, product, scale, mask)


def lora_expand_add(base: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None, widths: tuple[int, ...] | None = None) -> torch.Tensor:
    """lora_add(base, matmul(h, b), scale, mask): a LoRA term's expand (h [..., r], B [N, r]) and epilogue, the
    same bits. `widths`: a projection group's terms side by side (one adapter, one rank r): member j's columns
    of base and rows of B, its block j of h [..., members * r]. One launch on GPU where no gradient is taken
    (rollouts, the trainer's no-grad passes): the product never reaches memory. With a gradient, the
    differentiable ops one member at a time."""
    _check("base", base, dtype=torch.bfloat16)
    _check("h", h, dtype=torch.bfloat16)
    _check("b", b, dims=2, dtype=torch.bfloat16)
    widths = tuple(widths or (base.shape[-1],))
    r = b.shape[1]
    if (base.shape[:-1] != h.shape[:-1] or b.shape[0] != base.shape[-1] or sum(widths) != base.shape[-1]
            or min(widths) < 1 or h.shape[-1] != len(widths) * r):
        raise ValueError(f"lora_expand_add takes base [..., N], h [..., members * r] and b [N, r] with member widths "
                         f"summing to N, got {tuple(base.shape)}, {tuple(h.shape)}, {tuple(b.shape)} and {widths}")
    _check_lora_mask(base, mask)
    _same_device(base, h, b, mask)
    if torch.is_grad_enabled() and (base.requires_grad or h.requires_grad or b.requires_grad):
        return per_member(lambda x, hj, bj: lora_add(x, matmul(hj, bj), scale, mask), base, h, b, widths)
    return backend_for(base).lora_expand_add(base, h, b, scale, mask, widths)


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s, weight, eps)) with s = add(a, b): the residual add and the next norm, the same
    bits as the two ops; one launch on GPU (with or without a gradient: one autograd node for both)."""
    backend = backend_for(a)
    if backend is reference:
        s = add(a, b)
        return s, rms_norm(s, weight, eps)
    for name, t in (("a", a), ("b", b)):
        _check(name, t, dtype=torch.bfloat16)
    _check("weight", weight, dims=1, dtype=torch.bfloat16)
    if a.shape != b.shape or a.shape[-1] != weight.shape[0]:
        raise ValueError(f"add_rms_norm: a {tuple(a.shape)}, b {tuple(b.shape)}, weight {tuple(weight.shape)}")
    _same_device(a, b, weight)
    return add_rms_norm_with_grad(lambda a_, b_, w_: backend.add_rms_norm(a_, b_, w_, eps), a, b, weight, eps)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary(q), rotary(k)): one launch on GPU (with or without a gradient), the same bits."""
    backend = backend_for(q)
    if backend is reference:
        return rotary(q, cos, sin), rotary(k, cos, sin)
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"rotary_qk: q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, T, H, D] alike")
    return rotary_qk_with_grad(backend.rotary_qk, q, k, cos, sin)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes token n's K and V [Hkv, D] at (blocks[n], offsets[n]) of paged pools [NB, BS, Hkv, D]
    (strided views allowed); a copy, one launch on GPU."""
    if k.shape != v.shape or k.dim() != 3 or k_pool.shape[2:] != k.shape[1:]:
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit pools {tuple(k_pool.shape)}")
    backend_for(k).write_kv(k_pool, v_pool, blocks, offsets, k, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
              block_table: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Canonical causal GQA attention; query (b, t) sees keys 0..positions[b, t] of sequence b.

    q [B, T, Hq, D] bf16. Contiguous KV: k, v [B, L, Hkv, D] (key j at position j). Paged KV:
    k, v [num_blocks, block_size, Hkv, D] with block_table [B, max_blocks]. Negative positions are
    padding rows. KV is visited in blocks of kernel_family(q.device).attention_block_kv positions from 0,
    in splits of attention_split_kv positions merged in order, whatever the layout.
    """
    _check("q", q, dims=4, dtype=torch.bfloat16)
    _check("k", k, dims=4, dtype=torch.bfloat16)
    _check("v", v, dims=4, dtype=torch.bfloat16)
    _same_device(q, k, v, positions, block_table)
    if positions.shape != q.shape[:2]:
        raise ValueError(f"positions {tuple(positions.shape)} must be [B, T] = {tuple(q.shape[:2])}")
    if q.shape[2] % k.shape[2] or q.shape[3] != k.shape[3] or k.shape != v.shape:
        raise ValueError(f"bad GQA shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if block_table is None and k.shape[0] != q.shape[0]:
        raise ValueError("contiguous KV must have one sequence per query batch row")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    impl = backend_for(q).attention
    family = kernel_family(q.device)
    fwd = lambda q_, k_, v_: impl(q_, k_, v_, positions, block_table=block_table, scale=scale,  # noqa: E731
                                  block_kv=family.attention_block_kv, split_kv=family.attention_split_kv)
    if block_table is not None:
        return fwd(q, k, v)
    return attention_with_grad(fwd, q, k, v, positions, scale)


def attention_sequences(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: PackedRow, *,
                        scale: float | None = None) -> torch.Tensor:
    """Canonical causal attention of a packed row: q [1, N, Hq, D], k, v [1, N, Hkv, D] bf16 hold the
    sequences row.lengths back to back, positions 0..L-1 each. Every query row gets the bits
    `attention` gives it with its sequence alone, in one launch (kernels.packed_attention).
    Differentiable."""
    _check("q", q, dims=4, dtype=torch.bfloat16)
    _check("k", k, dims=4, dtype=torch.bfloat16)
    _check("v", v, dims=4, dtype=torch.bfloat16)
    _same_device(q, k, v, row.positions)
    if q.shape[0] != 1 or k.shape[:2] != q.shape[:2] or k.shape != v.shape or sum(row.lengths) != q.shape[1]:
        raise ValueError(f"a packed row is q [1, N, Hq, D], k, v [1, N, Hkv, D] with N = sum(lengths) = "
                         f"{sum(row.lengths)}; got q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if q.shape[2] % k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"bad GQA shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    impl = backend_for(q).attention_packed
    family = kernel_family(q.device)

    def fwd(q_, k_, v_):  # the row's keys as one-token pages: [N, 1, Hkv, D]
        out = torch.empty_like(q_[0])
        impl(q_[0], k_[0].unsqueeze(1), v_[0].unsqueeze(1), row.positions, row.key_table, row.query_start,
             row.query_len, row.max_len, out, scale, family.attention_block_kv, family.attention_split_kv)
        return out[None]
    return packed_attention_with_grad(fwd, q, k, v, row, scale)


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     block_table: torch.Tensor, query_start: torch.Tensor, query_len: torch.Tensor,
                     max_query_len: int, *, out: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """`attention` over paged KV for B sequences whose queries lie back to back in one flat batch, read
    and written in place (no padded copy): sequence b's are rows query_start[b] .. query_start[b] +
    query_len[b] - 1 of q [N, Hq, D] bf16 (1 <= query_len[b] <= max_query_len), positions [N], keys
    behind block_table[b] of k, v [num_blocks, block_size, Hkv, D]. Writes those rows of out [N, Hq, D]
    (a new tensor when None; other rows are left as they are), each with the numbers `attention` gives
    it. Inference only: no gradient."""
    _check("q", q, dims=3, dtype=torch.bfloat16)
    _check("k", k, dims=4, dtype=torch.bfloat16)
    _check("v", v, dims=4, dtype=torch.bfloat16)
    _same_device(q, k, v, positions, block_table, query_start, query_len, out)
    if positions.shape != q.shape[:1]:
        raise ValueError(f"positions {tuple(positions.shape)} must be [N] = {tuple(q.shape[:1])}")
    if q.shape[1] % k.shape[2] or q.shape[2] != k.shape[3] or k.shape != v.shape:
        raise ValueError(f"bad GQA shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if query_start.dim() != 1 or query_len.shape != query_start.shape or block_table.shape[0] != query_start.shape[0]:
        raise ValueError(f"query_start {tuple(query_start.shape)}, query_len {tuple(query_len.shape)} and "
                         f"block_table {tuple(block_table.shape)} must describe the same B sequences")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != torch.bfloat16:
        raise ValueError(f"out must be bf16 of q's shape {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    if query_start.numel() == 0:
        return out
    family = kernel_family(q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return backend_for(q).attention_packed(q, k, v, positions, block_table, query_start, query_len,
                                           int(max_query_len), out, scale, family.attention_block_kv,
                                           family.attention_split_kv)


__all__ = ["CanonicalConfig", "CanonicalMismatchError", "TREE_SEGMENTS_ENV", "TREE_WIDTHS", "add", "add_rms_norm",
           "lora_add", "lora_expand_add", "PackedRow", "attention", "attention_packed", "attention_sequences",
           "backend_for", "canonical_config", "check_canonical", "gumbel_noise", "head_token_logprobs",
           "kernel_family", "log_softmax", "logprob_temperature", "mask_vocab_tail", "matmul", "rms_norm",
           "rotary", "rotary_qk", "sample", "sampling_position", "sampling_positions", "scale_logits",
           "set_tree_segments", "silu_mul", "token_logprobs", "tree_segments", "write_kv"]
