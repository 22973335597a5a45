"""The weight fingerprint's row sums on the GPU, in one pass over a tensor's bf16 bits.

rollout_service.weights defines the fingerprint; this computes its inner step, each row's
sum over its 2**14 elements of (bits + 2**15 + 1) * in-row weight, for both lanes. Every product is
below 2**31 and every sum an integer added in int64, so the result is exact and equals the host's
float64 matmul bit for bit. One program per row reads the row once: memory speed, where a float64
matmul with two output columns runs far below it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _row_sums_kernel(bits_ptr, weights_ptr, out_ptr, n, ROW: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * ROW
    acc0 = tl.zeros([BLOCK], dtype=tl.int64)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    for off in range(0, ROW, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        inside = base + cols < n
        b = tl.load(bits_ptr + base + cols, mask=inside, other=0).to(tl.int32)
        v = tl.where(inside, b + 32769, 0)  # elements past the end add nothing
        acc0 += (v * tl.load(weights_ptr + cols)).to(tl.int64)
        acc1 += (v * tl.load(weights_ptr + ROW + cols)).to(tl.int64)
    tl.store(out_ptr + row * 2, tl.sum(acc0, 0))
    tl.store(out_ptr + row * 2 + 1, tl.sum(acc1, 0))


def fingerprint_row_sums(bits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[rows, 2] int64 row sums of a flat int16 tensor; `weights` is [2, ROW] int32 (contiguous)."""
    row = weights.shape[1]
    rows = -(-bits.numel() // row)
    out = torch.empty(rows, 2, dtype=torch.int64, device=bits.device)
    if rows:
        _row_sums_kernel[(rows,)](bits, weights, out, bits.numel(), ROW=row, BLOCK=_BLOCK)
    return out
