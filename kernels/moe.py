"""Canonical mixture-of-experts MLP (Qwen3-MoE's sparse block), over an op set.

The rule, for each token on its own:
- router logits = the op set's fp32 `logits` matmul of the token's hidden state with the router
  weight (the canonical matmul for CANONICAL_OPS);
- probabilities = exp(log_softmax(logits)) in fp32;
- the top k by probability, ties to the lowest expert id (a stable sort);
- weights: the top-k probabilities, divided by their sum (taken in rank order) when the model sets
  `norm_topk_prob`, all in fp32;
- each chosen expert's SwiGLU MLP on the token's row (canonical matmuls: a row's result does not
  depend on which other tokens the expert serves);
- output = bf16 of the fp32 sum over the chosen experts in expert-id order of weight * expert output.
So a token's routing and output depend only on its own hidden state, never on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    norm_topk_prob: bool


def moe_spec(config) -> MoESpec | None:
    """The MoE settings of a config with sparse layers, else None."""
    num_experts = getattr(config, "num_experts", 0) or 0
    if num_experts <= 0:
        return None
    return MoESpec(num_experts, config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", False)))


def is_moe_block(mlp: torch.nn.Module) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def route(x: torch.Tensor, router_weight: torch.Tensor, spec: MoESpec, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, k] in increasing id order, their fp32 weights [N, k]) for rows x [N, H]."""
    logits = ops.logits(x, router_weight)  # fp32 [N, E]
    probs = torch.exp(ops.log_softmax(logits))
    order = torch.sort(probs, dim=-1, descending=True, stable=True)  # equal probabilities: lower id first
    top_p, top_ids = order.values[:, :spec.top_k], order.indices[:, :spec.top_k]
    if spec.norm_topk_prob:
        total = top_p[:, 0]
        for j in range(1, spec.top_k):  # a fixed order, not a reduction tree
            total = total + top_p[:, j]
        top_p = top_p / total.unsqueeze(-1)
    ids, by_id = torch.sort(top_ids, dim=-1)  # combine in expert-id order
    return ids, top_p.gather(-1, by_id)


def moe_forward(block: torch.nn.Module, x: torch.Tensor, spec: MoESpec, ops, bf16, routing: list | None = None):
    """The sparse block on x [B, T, H] (bf16) -> [B, T, H] bf16. `bf16(param)` reads a weight as bf16
    (under FSDP2, the unsharded parameter). `routing`, when a list, receives this layer's expert ids."""
    b, t, h = x.shape
    rows = x.reshape(-1, h)
    ids, weights = route(rows, bf16(block.gate.weight), spec, ops)
    if routing is not None:
        routing.append(ids.reshape(b, t, spec.top_k))
    gate_up, down = bf16(block.experts.gate_up_proj), bf16(block.experts.down_proj)
    contributions = rows.new_zeros(rows.shape[0], spec.top_k, h, dtype=torch.float32)
    for e in torch.unique(ids).tolist():  # experts with work, each over all of its rows at once
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        gate, up = ops.linear(rows[token], gate_up[e]).chunk(2, dim=-1)
        y = ops.linear(ops.silu_mul(gate.contiguous(), up.contiguous()), down[e])
        contributions = contributions.index_put((token, slot), y.float() * weights[token, slot].unsqueeze(-1))
    out = contributions[:, 0]
    for j in range(1, spec.top_k):
        out = out + contributions[:, j]
    return out.to(torch.bfloat16).reshape(b, t, h)
