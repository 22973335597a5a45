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
    # a LoRA term's scale, add and select (base, product, scale, mask) -> bf16, the same bits as those ops
    lora_add: Callable = K.lora_add
    # a LoRA term's expand and epilogue (base, h, B, scale, mask) -> bf16, the same bits as linear(h, B) then
    # lora_add; None: those two ops (an op set whose linear is its own)
    lora_expand_add: Callable | None = None
    rotary: Callable = K.rotary
    log_softmax: Callable = K.log_softmax  # fp32 rows (MoE routing)
    # one-launch forms of add + rms_norm and of rotary on q and k (same bits as the ops they replace);
    # None: the forward runs those ops one by one
    fused_add_rms_norm: Callable | None = None  # (a, b, weight, eps) -> (a + b, rms_norm(a + b))
    fused_rotary_qk: Callable | None = None  # (q, k, cos, sin) -> (rotary(q), rotary(k))
    # MoE experts may run as the grouped kernels (kernels/triton/moe.py: each row exactly as the
    # canonical matmul computes it, no host sync) where the device has them; else the loop over experts
    grouped_experts: bool = False
    # paged attention over packed query rows, in place (kernels.attention_packed); None: an op set that
    # cannot attend over vLLM's paged cache
    attention_packed: Callable | None = None
    # causal attention of a packed training row's sequences, each alone, in one launch
    # (kernels.attention_sequences): (q, k, v, PackedRow, scale) -> bf16; None: one call per sequence
    attention_sequences: Callable | None = None

    def add_rms_norm(self, a, b, weight, eps):
        if self.fused_add_rms_norm is not None:
            return self.fused_add_rms_norm(a, b, weight, eps)
        s = self.add(a, b)
        return s, self.rms_norm(s, weight, eps)

    def rotary_qk(self, q, k, cos, sin):
        if self.fused_rotary_qk is not None:
            return self.fused_rotary_qk(q, k, cos, sin)
        return self.rotary(q, cos, sin), self.rotary(k, cos, sin)


CANONICAL_OPS = OpSet(
    name="canonical",
    linear=lambda x, w, b=None, row_parallel=False: K.matmul(x, w, b, row_parallel=row_parallel),
    logits=lambda x, w: K.matmul(x, w, out_dtype=torch.float32),
    rms_norm=K.rms_norm,
    attention=lambda q, k, v, positions, block_table=None, scale=None: K.attention(
        q, k, v, positions, block_table=block_table, scale=scale),
    silu_mul=K.silu_mul,
    fused_add_rms_norm=K.add_rms_norm,
    fused_rotary_qk=K.rotary_qk,
    grouped_experts=True,
    lora_expand_add=K.lora_expand_add,
    attention_packed=K.attention_packed,
    attention_sequences=lambda q, k, v, row, scale=None: K.attention_sequences(q, k, v, row, scale=scale),
)
