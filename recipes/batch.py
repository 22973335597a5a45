"""Turn scored rollouts into padded training tensors, split over trainer ranks and mini-batches.

Every rank must run the same number of forwards and backwards (FSDP's collectives pair up), so a
rank with no rows in a micro-batch gets a one-row dummy whose loss mask is all zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens
    logprobs: list[float]  # the rollout's log-prob of each generated token
    advantage: float
    routed_experts: list | None = None  # per generated token [moe_layers][k] expert ids (Rollout.routed_experts)
    weight_versions: list[int] | None = None  # per generated token, the weight version that produced it


def pack(samples: list[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded tensors; [B, T-1] ones are aligned with token_logprobs (index t-1 = token t).
    When the samples carry routed experts: "rollout_routed_experts" [B, T-1, moe_layers, k] (int16,
    -1 outside the loss mask), aligned the same way. "weight_version" [B, T-1]: each token's weight version
    (-1 outside the loss mask and where the rollout recorded none)."""
    if not samples:
        samples, dummy = [Sample([pad_id], [pad_id], [0.0], 0.0)], True
    else:
        dummy = False
    width = max(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width - 1, dtype=torch.bool)
    old = torch.zeros(n, width - 1, dtype=torch.float32)
    versions = torch.full((n, width - 1), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        p, g = len(s.prompt_ids), len(s.token_ids)
        ids[i, :p + g] = torch.tensor(s.prompt_ids + s.token_ids)
        attn[i, :p + g] = 1
        if not dummy:
            loss_mask[i, p - 1:p - 1 + g] = True
            old[i, p - 1:p - 1 + g] = torch.tensor(s.logprobs, dtype=torch.float32)
            if s.weight_versions is not None:
                versions[i, p - 1:p - 1 + g] = torch.tensor(s.weight_versions, dtype=torch.long)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    out = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "rollout_logprobs": old,
           "advantages": adv, "weight_version": versions}
    if not dummy and any(s.routed_experts is not None for s in samples):
        out["rollout_routed_experts"] = _pack_routing(samples, width)
    return out


def _pack_routing(samples: list[Sample], width: int) -> torch.Tensor:
    if any(s.routed_experts is None for s in samples):
        raise ValueError("some samples carry routed experts and some do not")
    if any(len(s.routed_experts) != len(s.token_ids) for s in samples):
        raise ValueError("a sample's routed_experts must have one entry per generated token")
    first = next(s.routed_experts[0] for s in samples if s.routed_experts)
    layers, k = len(first), len(first[0]) if first else 0
    out = torch.full((len(samples), width - 1, layers, k), -1, dtype=torch.int16)  # expert ids < 32768
    for i, s in enumerate(samples):
        p, g = len(s.prompt_ids), len(s.token_ids)
        if g:
            out[i, p - 1:p - 1 + g] = torch.tensor(s.routed_experts, dtype=torch.int16)
    return out


def _chunks(items: list, parts: int) -> list[list]:
    """`parts` contiguous chunks of near-equal size (some may be empty)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append(items[start:stop])
        start = stop
    return out


def split_for_ranks(samples: list[Sample], world: int, mini_batches: int, micro_batch_size: int = 0,
                    pad_id: int = 0) -> tuple[list[list[list[dict]]], list[int]]:
    """-> (per rank: per mini-batch: list of packed micro-batches, generated tokens per mini-batch).

    Mini-batches are contiguous slices of `samples` (whole prompt groups when the caller orders them
    so); within one, rows are dealt to ranks round-robin.
    """
    plans: list[list[list[dict]]] = [[] for _ in range(world)]
    tokens = []
    for mini in _chunks(samples, mini_batches):
        tokens.append(sum(len(s.token_ids) for s in mini))
        per_rank = [mini[r::world] for r in range(world)]
        rows = max(len(p) for p in per_rank)
        micros = max(1, -(-rows // micro_batch_size)) if micro_batch_size > 0 else 1
        for r in range(world):
            plans[r].append([pack(chunk, pad_id) for chunk in _chunks(per_rank[r], micros)])
    return plans, tokens
