"""Causal attention of a packed training row: sequences back to back in one row [1, N] whose positions
restart at 0 for each (Hugging Face's padding-free layout), each attending to its own keys only.

Forward: one canonical launch over all the sequences. The row's keys are read as a paged cache of
one-token pages whose block table lists each sequence's own keys, so a query row's numbers are those
`kernels.attention` gives it with its sequence alone (paged and contiguous KV differ only in how a
key's address is found). Backward: the standard formula by one variable-length flash launch on CUDA
(kernels.backward's rule: gradients are the unpatched model's, not bit-matched), else a pass of
attention_ref per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .backward import _flash_backward_ok, attention_ref


def packed_lengths(positions: torch.Tensor) -> tuple[int, ...] | None:
    """The sequence lengths of a packed row, or None for ordinary rows.

    The layout is Hugging Face's padding-free one: sequences back to back in one row [1, N] whose
    positions restart at 0 for each (0..L1-1, 0..L2-1, ...). Any other restart of the positions is
    refused: contiguous attention reads key j at position j of its row."""
    if positions.dim() != 2 or positions.shape[1] < 2:
        return None
    starts = (positions[:, 1:] == 0).nonzero()
    if starts.numel() == 0:
        return None
    if positions.shape[0] != 1:
        raise ValueError(f"packed sequences (positions restarting at 0) go in one row [1, N]; got "
                         f"positions of shape {tuple(positions.shape)}")
    row = positions[0]
    bounds = [0, *(starts[:, 1] + 1).tolist(), row.shape[0]]
    lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    expected = torch.cat([torch.arange(n, device=row.device) for n in lengths])
    if not torch.equal(row, expected):
        raise ValueError("a packed row's positions must run 0..L-1 for each of its sequences")
    return lengths


@dataclass(frozen=True)
class PackedRow:
    """Where each sequence of a packed row lies; built once a forward and shared by its layers."""
    lengths: tuple[int, ...]
    positions: torch.Tensor  # [N] 0..L-1 for each sequence
    query_start: torch.Tensor  # [S] int32: the first row of each sequence
    query_len: torch.Tensor  # [S] int32
    key_table: torch.Tensor  # [S, max_len] int32: the row index of key j of sequence s (clamped past its end)
    cu_seqlens: torch.Tensor  # [S + 1] int32: the flash kernels' varlen layout
    max_len: int

    @staticmethod
    def of(lengths: tuple[int, ...], positions: torch.Tensor) -> PackedRow:
        """positions [1, N]: the row's, already checked to run 0..L-1 per sequence (packed_lengths)."""
        device = positions.device
        lens = torch.tensor(lengths, dtype=torch.int32)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        max_len = max(lengths)
        # key j of sequence s is row start_s + j; past its end the entry repeats its last key (never
        # read: the kernel loads only keys at or before some query's position)
        table = cu[:-1, None] + torch.minimum(torch.arange(max_len, dtype=torch.int32)[None, :], lens[:, None] - 1)
        return PackedRow(tuple(lengths), positions.reshape(-1), cu[:-1].to(device), lens.to(device),
                         table.to(device), cu.to(device), max_len)


class _PackedAttention(torch.autograd.Function):
    """canonical(q, k, v) forward; the causal-attention backward of each sequence alone."""

    @staticmethod
    def forward(ctx, canonical: Callable, q, k, v, row: PackedRow, scale: float):
        ctx.save_for_backward(q, k, v)
        ctx.row, ctx.scale = row, scale
        return canonical(q, k, v)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        if _flash_backward_ok(q):
            grads = _varlen_flash_grads(q, k, v, grad_out, ctx.row, ctx.scale)
        else:
            grads = _per_sequence_grads(q, k, v, grad_out, ctx.row, ctx.scale)
        return (None, *(g if want else None for g, want in zip(grads, ctx.needs_input_grad[1:4])), None, None)


def _varlen_flash_grads(q, k, v, grad_out, row: PackedRow, scale: float):
    """(dq, dk, dv) by PyTorch's variable-length flash kernels: the forward again for the softmax
    statistics, then the backward, each one launch for every sequence of the row."""
    q0, k0, v0 = q[0], k[0], v[0]  # [N, H, D]; the flash kernels group query heads themselves
    cu, n = row.cu_seqlens, row.max_len
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q0, k0, v0, cu, cu, n, n, 0.0, True, False, scale=scale)
    g = grad_out[0].to(q.dtype)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        g if g.stride(-1) == 1 else g.contiguous(), q0, k0, v0, out, lse, cu, cu, n, n, 0.0, True, rng,
        unused, scale=scale)
    return dq[None], dk[None], dv[None]


def _per_sequence_grads(q, k, v, grad_out, row: PackedRow, scale: float):
    grads = [torch.empty_like(t) for t in (q, k, v)]
    start = 0
    for length in row.lengths:
        rows = slice(start, start + length)
        inputs = [t[:, rows].detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out = attention_ref(*inputs, None, scale, from_zero=True)
        for whole, part in zip(grads, torch.autograd.grad(out, inputs, grad_out[:, rows].to(out.dtype))):
            whole[:, rows] = part
        start += length
    return grads


def packed_attention_with_grad(canonical: Callable, q, k, v, row: PackedRow, scale: float):
    """canonical(q, k, v), differentiable as each sequence's causal attention when grad is needed."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _PackedAttention.apply(canonical, q, k, v, row, scale)
    return canonical(q, k, v)
