"""Turn scored rollouts into training tensors, split over trainer ranks, mini-batches and micro-batches.

Two layouts: padded rows [B, T] (`pack`), or every sequence of a micro-batch back to back in one row
[1, N] whose positions restart at 0 for each (`pack_flat`, Hugging Face's padding-free layout): no pad
token reaches a matmul or attention, and the canonical forward scores each sequence as if alone.

Micro-batches hold a number of sequences (micro_batch_size) or, with a token budget, as many whole
sequences as fit in it (max_tokens_per_micro_batch, verl's ppo_max_token_len_per_gpu). Every rank must
run the same number of forwards and backwards (FSDP's collectives pair up), so a rank with fewer
micro-batches gets dummies: one short row whose loss mask is all zero.
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
    # per token of token_ids, True where the model sampled it (a multi-turn episode's observations are False:
    # out of the loss and the KL, their logprobs unused); None: every token is the model's
    model_mask: list[bool] | None = None


# The micro-batch tensors a train step's forwards and loss read (the trainer copies them to the device up front);
# the others (weight versions, routing) serve its checks on the host.
STEP_INPUTS = ("input_ids", "position_ids", "attention_mask", "loss_mask", "rollout_logprobs", "advantages")


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
            loss_mask[i, p - 1:p - 1 + g] = _model_tokens(s)
            old[i, p - 1:p - 1 + g] = torch.tensor(s.logprobs, dtype=torch.float32)
            if s.weight_versions is not None:
                versions[i, p - 1:p - 1 + g] = torch.tensor(s.weight_versions, dtype=torch.long)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    out = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "rollout_logprobs": old,
           "advantages": adv[:, None].expand(n, width - 1).contiguous(), "weight_version": versions}
    if not dummy and any(s.routed_experts is not None for s in samples):
        out["rollout_routed_experts"] = _pack_routing(samples, [(i, 0) for i in range(n)], (n, width - 1))
    return out


def pack_flat(samples: list[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Every sample back to back in one row: "input_ids" and "position_ids" [1, N] (positions 0..L-1 per
    sample), the per-token tensors of `pack` as [1, N-1] (index t = token t + 1; the index before a sample's
    first token, which would score it from the previous sample, is outside the loss mask). "advantages" is
    per token, each sample's own. No samples: a dummy of two pad tokens with an empty loss mask."""
    if not samples:
        samples, dummy = [Sample([pad_id], [pad_id], [0.0], 0.0)], True
    else:
        dummy = False
    n = sum(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    ids = torch.tensor([t for s in samples for t in s.prompt_ids + s.token_ids], dtype=torch.long)[None]
    positions = torch.cat([torch.arange(len(s.prompt_ids) + len(s.token_ids)) for s in samples])[None]
    loss_mask = torch.zeros(1, n - 1, dtype=torch.bool)
    old = torch.zeros(1, n - 1, dtype=torch.float32)
    adv = torch.zeros(1, n - 1, dtype=torch.float32)
    versions = torch.full((1, n - 1), -1, dtype=torch.long)
    starts, start = [], 0
    for s in samples:
        p, g = len(s.prompt_ids), len(s.token_ids)
        starts.append((0, start))
        first = start + p - 1  # index of the log-prob of the first generated token
        if not dummy:
            loss_mask[0, first:first + g] = _model_tokens(s)
            old[0, first:first + g] = torch.tensor(s.logprobs, dtype=torch.float32)
            adv[0, first:first + g] = s.advantage
            if s.weight_versions is not None:
                versions[0, first:first + g] = torch.tensor(s.weight_versions, dtype=torch.long)
        start += p + g
    out = {"input_ids": ids, "position_ids": positions, "loss_mask": loss_mask, "rollout_logprobs": old,
           "advantages": adv, "weight_version": versions}
    if not dummy and any(s.routed_experts is not None for s in samples):
        out["rollout_routed_experts"] = _pack_routing(samples, starts, (1, n - 1))
    return out


def _model_tokens(s: Sample) -> torch.Tensor | bool:
    if s.model_mask is None:
        return True
    if len(s.model_mask) != len(s.token_ids):
        raise ValueError(f"a sample's model_mask has {len(s.model_mask)} entries for {len(s.token_ids)} tokens")
    return torch.tensor(s.model_mask, dtype=torch.bool)


def real_tokens(mb: dict[str, torch.Tensor]) -> int:
    """Tokens of a micro-batch that are not padding (a dummy's count too: it is run like the others)."""
    return int(mb["attention_mask"].sum()) if "attention_mask" in mb else mb["input_ids"].numel()


def _pack_routing(samples: list[Sample], starts: list[tuple[int, int]], shape: tuple[int, int]) -> torch.Tensor:
    """Routed experts aligned like the log-probs; sample i's tokens start at (row, column) starts[i]."""
    if any(s.routed_experts is None for s in samples):
        raise ValueError("some samples carry routed experts and some do not")
    if any(len(s.routed_experts) != len(s.token_ids) for s in samples):
        raise ValueError("a sample's routed_experts must have one entry per generated token")
    first = next(s.routed_experts[0] for s in samples if s.routed_experts)
    layers, k = len(first), len(first[0]) if first else 0
    out = torch.full((*shape, layers, k), -1, dtype=torch.int16)  # expert ids < 32768
    for (row, col), s in zip(starts, samples):
        p, g = len(s.prompt_ids), len(s.token_ids)
        if g:
            out[row, col + p - 1:col + p - 1 + g] = torch.tensor(s.routed_experts, dtype=torch.int16)
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


def _length(s: Sample) -> int:
    return len(s.prompt_ids) + len(s.token_ids)


def budget_groups(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Whole samples grouped so that each group's tokens stay within max_tokens: first-fit decreasing
    (longest first, each into the first group with room), deterministic, each group in sample order."""
    too_long = [_length(s) for s in samples if _length(s) > max_tokens]
    if too_long:
        raise ValueError(f"a sequence of {max(too_long)} tokens does not fit "
                         f"trainer.batching.max_tokens_per_micro_batch={max_tokens}: raise it to at least the longest "
                         f"prompt + rollout.max_tokens")
    order = sorted(range(len(samples)), key=lambda i: (-_length(samples[i]), i))
    groups: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for g, left in enumerate(room):
            if _length(samples[i]) <= left:
                groups[g].append(i)
                room[g] -= _length(samples[i])
                break
        else:
            groups.append([i])
            room.append(max_tokens - _length(samples[i]))
    return [[samples[i] for i in sorted(g)] for g in groups]


def _group_chunks(samples: list[Sample], sizes: list[int], parts: int) -> list[list[Sample]]:
    """`parts` contiguous chunks of `samples` made of whole groups (sizes[i]: the i-th group's samples)."""
    if sum(sizes) != len(samples):
        raise ValueError(f"prompt groups of {sum(sizes)} samples in all for {len(samples)} samples")
    out, start = [], 0
    for chunk in _chunks(sizes, parts):
        out.append(samples[start:start + sum(chunk)])
        start += sum(chunk)
    return out


def split_for_ranks(samples: list[Sample], world: int, mini_batches: int, micro_batch_size: int = 0,
                    pad_id: int = 0, max_tokens_per_micro_batch: int = 0,
                    packed: bool = False,
                    group_sizes: list[int] | None = None) -> tuple[list[list[list[dict]]], list[int]]:
    """-> (per rank: per mini-batch: list of micro-batches, generated tokens per mini-batch).

    Mini-batches are contiguous slices of `samples` (whole prompt groups when the caller orders them
    so; `group_sizes`, each prompt group's number of samples in order, makes them whole groups where groups
    differ in size: a multi-turn episode is as many samples as it has segments); within one, rows are
    dealt to ranks round-robin. A rank's rows form micro-batches of at most
    max_tokens_per_micro_batch tokens when it is > 0 (budget_groups), else micro_batch_size rows (0: all);
    ranks with fewer micro-batches than another get dummies. packed: pack_flat micro-batches, else pack.
    """
    make = pack_flat if packed else pack
    plans: list[list[list[dict]]] = [[] for _ in range(world)]
    tokens = []
    if group_sizes is None:
        minis = _chunks(samples, mini_batches)
    else:
        minis = _group_chunks(samples, group_sizes, mini_batches)
    for mini in minis:
        tokens.append(sum(len(s.token_ids) for s in mini))
        per_rank = [mini[r::world] for r in range(world)]
        if max_tokens_per_micro_batch > 0:
            groups = [budget_groups(rows, max_tokens_per_micro_batch) for rows in per_rank]
            micros = max(1, max(len(g) for g in groups))
            groups = [g + [[]] * (micros - len(g)) for g in groups]
        else:
            rows = max(len(p) for p in per_rank)
            micros = max(1, -(-rows // micro_batch_size)) if micro_batch_size > 0 else 1
            groups = [_chunks(rows_r, micros) for rows_r in per_rank]
        for r in range(world):
            plans[r].append([make(chunk, pad_id) for chunk in groups[r]])
    return plans, tokens
