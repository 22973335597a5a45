"""The weight fingerprint's row sums on the GPU: one launch for every row of every tensor in a buffer.

rollout_service.weights defines the fingerprint; this computes its inner step, each row's sum over
its (at most 2**14) elements of (bits + 2**15 + 1) * in-row weight, for both lanes, and counts the
row's non-finite values (the sender's finiteness check, in the same read). A row is given
by its start in the flat int16 buffer and its length, so the rows of all the tensors packed in one
weight-sync bucket (hundreds of tensors, many of them small) take one launch, not one per tensor.
Every product is below 2**31 and every sum an integer added in int64, so the result is exact and
equals the host's float64 matmul bit for bit. One program per row reads the row once: memory speed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _row_sums_kernel(bits_ptr, starts_ptr, lengths_ptr, weights_ptr, out_ptr, ROW: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.load(starts_ptr + row)  # int64
    length = tl.load(lengths_ptr + row)
    acc0 = tl.zeros([BLOCK], dtype=tl.int64)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(0, ROW, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        inside = cols < length
        b = tl.load(bits_ptr + start + cols, mask=inside, other=0).to(tl.int32)
        v = tl.where(inside, b + 32769, 0)  # elements past the row's end add nothing
        acc0 += (v * tl.load(weights_ptr + cols)).to(tl.int64)
        acc1 += (v * tl.load(weights_ptr + ROW + cols)).to(tl.int64)
        bad += (inside & ((b & 0x7F80) == 0x7F80)).to(tl.int32)  # exponent all ones: inf or NaN
    tl.store(out_ptr + row * 3, tl.sum(acc0, 0))
    tl.store(out_ptr + row * 3 + 1, tl.sum(acc1, 0))
    tl.store(out_ptr + row * 3 + 2, tl.sum(bad, 0).to(tl.int64))


def fingerprint_row_sums(bits: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    """[rows, 3] int64 for a flat int16 buffer of bf16 bits, row i being bits[starts[i]:starts[i] +
    lengths[i]] (int64 starts, int32 lengths of at most ROW; `weights` is [2, ROW] int32, contiguous):
    the row's two weighted sums and its count of non-finite values."""
    rows = starts.numel()
    out = torch.empty(rows, 3, dtype=torch.int64, device=bits.device)
    if rows:
        _row_sums_kernel[(rows,)](bits, starts, lengths, weights, out, ROW=weights.shape[1], BLOCK=_BLOCK)
    return out
