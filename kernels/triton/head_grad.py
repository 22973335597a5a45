"""The lm head's logit gradient in place: the trainer's backward, not a canonical op.

d log_softmax(z / t)[token] / dz = (onehot(token) - softmax(z / t)) / t, times the row's incoming gradient g.
The backward of kernels.head_token_logprobs recomputes a chunk's bf16 logits z [rows, V] and needs exactly
this, in bf16, for two GEMMs. In torch that is six passes over [rows, V] float32 tensors (cast, scale,
softmax, scale, scatter, cast); here it is one program per row reading its bf16 logits twice (the row's
max and sum of exponentials, then the gradient) and writing the bf16 gradient over them. Gradients need no
fixed bits (kernels/backward.py), so the sum may run in any order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _logits_grad_kernel(z_ptr, g_ptr, tok_ptr, V, limit, stride_z, t, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    zrow = z_ptr + row.to(tl.int64) * stride_z
    cols = tl.arange(0, BLOCK)
    # Pass 1: per lane, a running max and sum of exp(x - max) over the allowed ids [0, limit).
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, limit, BLOCK):
        c = start + cols
        x = tl.load(zrow + c, mask=c < limit, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, x)
        alive = m_new != float("-inf")  # a lane that has seen no id yet keeps (-inf, 0)
        s = tl.where(alive, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), axis=0)
    g = tl.load(g_ptr + row).to(tl.float32)
    token = tl.load(tok_ptr + row)
    # Pass 2: (onehot - p) * g / t; ids at or past limit have probability 0 and get no gradient.
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(zrow + c, mask=c < limit, other=float("-inf")).to(tl.float32) / t
        p = tl.exp(x - row_max) / total
        grad = (tl.where(c == token, 1.0, 0.0) - p) * g / t
        tl.store(zrow + c, grad.to(z_ptr.dtype.element_ty), mask=c < V)


def logits_grad_(z: torch.Tensor, g: torch.Tensor, tokens: torch.Tensor, t: float,
                 vocab_limit: int | None = None) -> torch.Tensor:
    """z [rows, V] bf16 logits, overwritten by (onehot(tokens) - softmax(z / t)) * g[:, None] / t (ids at or
    past vocab_limit: 0); returns z."""
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"logits_grad_ needs [rows, V] logits with contiguous rows, got {tuple(z.shape)} "
                         f"strides {z.stride()}")
    rows, vocab = z.shape
    if g.shape != (rows,) or tokens.shape != (rows,):
        raise ValueError(f"logits_grad_ needs one gradient and one token per row: {rows} rows, "
                         f"g {tuple(g.shape)}, tokens {tuple(tokens.shape)}")
    limit = vocab if vocab_limit is None else min(vocab_limit, vocab)
    if rows:
        _logits_grad_kernel[(rows,)](z, g.contiguous(), tokens.contiguous(), vocab, limit, z.stride(0), float(t),
                                     BLOCK=min(_BLOCK, triton.next_power_of_2(vocab)), num_warps=8)
    return z
