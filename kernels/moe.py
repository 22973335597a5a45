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

Two ways to run the experts (for CANONICAL_OPS, the same bits on a device): a loop over the experts with work (any op
set, any device; it sizes each expert's rows on the host), and, where the op set allows it
(OpSet.grouped_experts: CANONICAL_OPS, and the native fast path's ops) on CUDA, grouped
Triton kernels (kernels/triton/moe.py: rows sorted by expert on the device, one launch per projection,
no host sync), whose rows are computed exactly as the canonical matmul computes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels as K
from kernels.backward import with_reference_grad


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


def moe_forward(block: torch.nn.Module, x: torch.Tensor, spec: MoESpec, ops, bf16, routing: list | None = None, *,
                grouped: bool | None = None):
    """The sparse block on x [B, T, H] (bf16) -> [B, T, H] bf16. `bf16(param)` reads a weight as bf16
    (under FSDP2, the unsharded parameter). `routing`, when a list, receives this layer's expert ids.
    grouped: run the experts through the grouped kernels (True), the loop (False), or the grouped
    kernels wherever they apply (None: op sets that allow them, on CUDA); for CANONICAL_OPS both give
    the same bits."""
    b, t, h = x.shape
    rows = x.reshape(-1, h)
    ids, weights = route(rows, bf16(block.gate.weight), spec, ops)
    if routing is not None:
        routing.append(ids.reshape(b, t, spec.top_k))
    gate_up, down = bf16(block.experts.gate_up_proj), bf16(block.experts.down_proj)
    backend = grouped_backend(ops, rows)
    if grouped and backend is None:
        raise ValueError("grouped experts need an op set that allows them (OpSet.grouped_experts) and CUDA "
                         "tensors with the Triton backend")
    if backend is not None and grouped is not False:
        out = experts_grouped(rows, ids, weights, gate_up, down, spec, ops, backend)
    else:
        out = experts_loop(rows, ids, weights, gate_up, down, spec, ops)
    return out.reshape(b, t, h)


def experts_loop(rows, ids, weights, gate_up, down, spec: MoESpec, ops) -> torch.Tensor:
    """[N, H] bf16: each expert with work over all of its rows at once (host-sized), then the combine."""
    contributions = rows.new_zeros(rows.shape[0], spec.top_k, rows.shape[1], dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        gate, up = ops.linear(rows[token], gate_up[e]).chunk(2, dim=-1)
        y = ops.linear(ops.silu_mul(gate.contiguous(), up.contiguous()), down[e])
        contributions = contributions.index_put((token, slot), y.float() * weights[token, slot].unsqueeze(-1))
    out = contributions[:, 0]
    for j in range(1, spec.top_k):
        out = out + contributions[:, j]
    return out.to(torch.bfloat16)


def grouped_backend(ops, rows: torch.Tensor):
    """The grouped expert kernels (kernels.triton.moe) where `ops` allows them, else None."""
    if not ops.grouped_experts:
        return None
    return getattr(K.backend_for(rows), "moe", None)


def capturable(ops, device: torch.device) -> bool:
    """Whether the sparse block runs on `device` with no host sync, so a CUDA graph can hold it."""
    return grouped_backend(ops, torch.empty(0, device=device)) is not None


@dataclass(frozen=True)
class ExpertGroups:
    """The token slots (token t's j-th expert is slot t * k + j) sorted by expert, on the device."""
    slot: torch.Tensor  # [S] the slot of each grouped row
    token: torch.Tensor  # [S] its token row
    offsets: torch.Tensor  # [E + 1]: expert e's grouped rows are offsets[e] .. offsets[e + 1] - 1


def group_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """A stable sort of the slots by expert id; offsets by binary search (no host sync)."""
    sorted_ids, slot = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(num_experts + 1, device=ids.device, dtype=sorted_ids.dtype)
    return ExpertGroups(slot, slot // ids.shape[-1], torch.searchsorted(sorted_ids, experts))


def experts_grouped(rows, ids, weights, gate_up, down, spec: MoESpec, ops, backend) -> torch.Tensor:
    """[N, H] bf16, the loop's bits: gate_up (+ silu_mul) and down as grouped canonical matmuls,
    then the combine. With gradients, silu_mul is the op set's own and each op has an ordinary backward."""
    groups = group_by_expert(ids, spec.num_experts)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (rows, weights, gate_up, down))):
        h = backend.grouped_matmul(rows, gate_up, groups.offsets, src=groups.token, silu=True)
        y = backend.grouped_matmul(h, down, groups.offsets, dst=groups.slot)
        return backend.combine(y, weights)
    gate, up = _GroupedLinear.apply(rows, gate_up, groups, backend, True, False).chunk(2, dim=-1)
    h = ops.silu_mul(gate.contiguous(), up.contiguous())
    y = _GroupedLinear.apply(h, down, groups, backend, False, True)
    return with_reference_grad(backend.combine, combine_reference, y, weights)


def combine_reference(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The combine in torch ops: y [N * k, H] bf16 in slot order, weights [N, k] fp32 -> [N, H] bf16."""
    c = y.reshape(*weights.shape, -1).float() * weights.unsqueeze(-1)
    out = c[:, 0]
    for j in range(1, weights.shape[1]):
        out = out + c[:, j]
    return out.to(torch.bfloat16)


class _GroupedLinear(torch.autograd.Function):
    """Grouped canonical x @ weight[e].T; backward by ordinary bf16 matmuls per expert.

    gather: x holds token rows, grouped row i is x[groups.token[i]] (output in grouped order).
    scatter: x holds grouped rows, output row groups.slot[i] (slot order)."""

    @staticmethod
    def forward(ctx, x, weight, groups: ExpertGroups, backend, gather: bool, scatter: bool):
        ctx.save_for_backward(x, weight)
        ctx.groups, ctx.gather, ctx.scatter = groups, gather, scatter
        return backend.grouped_matmul(x, weight, groups.offsets, src=groups.token if gather else None,
                                      dst=groups.slot if scatter else None)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        groups = ctx.groups
        g = (grad_out[groups.slot] if ctx.scatter else grad_out).to(weight.dtype)
        xs = x[groups.token] if ctx.gather else x
        grad_xs = torch.zeros_like(xs) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        bounds = groups.offsets.tolist()  # the backward may sync: it is never captured
        for e in range(weight.shape[0]):
            lo, hi = bounds[e], bounds[e + 1]
            if hi == lo:
                continue
            if grad_xs is not None:
                grad_xs[lo:hi] = g[lo:hi] @ weight[e]
            if grad_w is not None:
                grad_w[e] = g[lo:hi].T @ xs[lo:hi]
        grad_x = grad_xs
        if grad_xs is not None and ctx.gather:  # each token has top_k slots: sum them in fp32
            by_slot = torch.empty_like(grad_xs).index_copy_(0, groups.slot, grad_xs)
            grad_x = by_slot.reshape(x.shape[0], -1, x.shape[1]).float().sum(1).to(x.dtype)
        return grad_x, grad_w, None, None, None, None
