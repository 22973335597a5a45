"""The op sets a forward runs over: CANONICAL_OPS (the trainer and the verifier) or a fast path's own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import kernels as K


@dataclass(frozen=True)
class OpSet:
    """The ops a forward uses; CANONICAL_OPS or a fast path's own."""
    name: str
    linear: Callable  # (x, weight, bias, row_parallel) -> bf16
    logits: Callable  # (x, weight) -> float32
    rms_norm: Callable  # (x, weight, eps) -> bf16
    attention: Callable  # (q, k, v, positions, block_table, scale) -> bf16
    silu_mul: Callable
    add: Callable = K.add
    rotary: Callable = K.rotary
    log_softmax: Callable = K.log_softmax  # fp32 rows (MoE routing)
    # MoE experts may run as the grouped kernels (kernels/triton/moe.py: each row exactly as the
    # canonical matmul computes it, no host sync) where the device has them; else the loop over experts
    grouped_experts: bool = False


CANONICAL_OPS = OpSet(
    name="canonical",
    linear=lambda x, w, b=None, row_parallel=False: K.matmul(x, w, b, row_parallel=row_parallel),
    logits=lambda x, w: K.matmul(x, w, out_dtype=torch.float32),
    rms_norm=K.rms_norm,
    attention=lambda q, k, v, positions, block_table=None, scale=None: K.attention(
        q, k, v, positions, block_table=block_table, scale=scale),
    silu_mul=K.silu_mul,
    grouped_experts=True,
)
