"""The segment tree's top levels read straight from the other GPUs' memory (kernels.symm_tree).

Each rank's fp32 subtree node sits in a buffer every rank can address (peer pointers over NVLink).
`combine_peers` reads the k nodes of a block of elements, adds them in the tree's order
((n0+n1)+(n2+n3))+..., adds the bias and rounds: kernels.reference.exact_math.tree_combine, then
`+ bias.float()`, then `.to(out dtype)`, element for element (adds only, so no FMA can change a bit).
`combine_peer_columns` does the same for this rank's columns only and writes them to its own shared
buffer; `gather_peer_columns` then copies every rank's rounded columns into the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PEERS = 8  # the supported TP degrees are the divisors of the tree's width (at most 8 segments)
BLOCK = 2048


@triton.jit
def _tree_of_peers(p0, p1, p2, p3, p4, p5, p6, p7, offs, mask, K: tl.constexpr):
    """The tree over the first K peers' fp32 values at `offs` (K in 1, 2, 4, 8)."""
    a = tl.load(p0 + offs, mask=mask, other=0.0)
    if K >= 2:
        a = a + tl.load(p1 + offs, mask=mask, other=0.0)
    if K >= 4:
        a = a + (tl.load(p2 + offs, mask=mask, other=0.0) + tl.load(p3 + offs, mask=mask, other=0.0))
    if K >= 8:
        b = tl.load(p4 + offs, mask=mask, other=0.0) + tl.load(p5 + offs, mask=mask, other=0.0)
        c = tl.load(p6 + offs, mask=mask, other=0.0) + tl.load(p7 + offs, mask=mask, other=0.0)
        a = a + (b + c)
    return a


@triton.jit
def _rounded(v, OUT_BF16: tl.constexpr):
    return v.to(tl.bfloat16) if OUT_BF16 else v


@triton.jit(do_not_specialize=["numel"])
def _combine_peers_kernel(p0, p1, p2, p3, p4, p5, p6, p7, bias_ptr, out_ptr, numel, N,
                          K: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = _tree_of_peers(p0, p1, p2, p3, p4, p5, p6, p7, offs, mask, K)
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _rounded(v, OUT_BF16), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _combine_columns_kernel(p0, p1, p2, p3, p4, p5, p6, p7, bias_ptr, out_ptr, M, N, col0, cols,
                            K: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = col0 + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (c < col0 + cols) & (c < N)
    offs = row * N + c
    v = _tree_of_peers(p0, p1, p2, p3, p4, p5, p6, p7, offs, mask, K)
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _rounded(v, OUT_BF16), mask=mask)


@triton.jit(do_not_specialize=["numel"])
def _gather_columns_kernel(p0, p1, p2, p3, p4, p5, p6, p7, out_ptr, numel, N, cols,
                           K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    owner = (offs % N) // cols  # the rank that rounded this column
    v = tl.load(p0 + offs, mask=mask & (owner == 0), other=0.0)
    v = tl.where(owner == 1, tl.load(p1 + offs, mask=mask & (owner == 1), other=0.0), v)
    if K >= 4:
        v = tl.where(owner == 2, tl.load(p2 + offs, mask=mask & (owner == 2), other=0.0), v)
        v = tl.where(owner == 3, tl.load(p3 + offs, mask=mask & (owner == 3), other=0.0), v)
    if K >= 8:
        v = tl.where(owner == 4, tl.load(p4 + offs, mask=mask & (owner == 4), other=0.0), v)
        v = tl.where(owner == 5, tl.load(p5 + offs, mask=mask & (owner == 5), other=0.0), v)
        v = tl.where(owner == 6, tl.load(p6 + offs, mask=mask & (owner == 6), other=0.0), v)
        v = tl.where(owner == 7, tl.load(p7 + offs, mask=mask & (owner == 7), other=0.0), v)
    tl.store(out_ptr + offs, v, mask=mask)


def _padded(peers: list[torch.Tensor]) -> list[torch.Tensor]:
    k = len(peers)
    if k not in (1, 2, 4, 8):
        raise ValueError(f"the tree combines 1, 2, 4 or 8 peers, got {k}")
    return list(peers) + [peers[0]] * (MAX_PEERS - k)  # unused pointer slots are never read


def _out_bf16(out: torch.Tensor) -> bool:
    if out.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the tree rounds to bfloat16 or keeps float32, got {out.dtype}")
    return out.dtype == torch.bfloat16


def combine_peers(peers: list[torch.Tensor], bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out[...] = round(tree(peers) + bias): peers are k fp32 [M, N] nodes (any GPU memory this device
    can address), bias [N] or None, out [M, N] in the output dtype."""
    m, n = out.shape
    numel = m * n
    _combine_peers_kernel[(triton.cdiv(numel, BLOCK),)](
        *_padded(peers), bias if bias is not None else out, out, numel, n,
        K=len(peers), HAS_BIAS=bias is not None, OUT_BF16=_out_bf16(out), BLOCK=BLOCK, num_warps=8)
    return out


def combine_peer_columns(peers: list[torch.Tensor], bias: torch.Tensor | None, out: torch.Tensor,
                         col0: int, cols: int) -> torch.Tensor:
    """combine_peers for columns [col0, col0 + cols) only (the rest of `out` is left as it is)."""
    m, n = out.shape
    block = min(BLOCK, max(16, triton.next_power_of_2(cols)))
    _combine_columns_kernel[(m, triton.cdiv(cols, block))](
        *_padded(peers), bias if bias is not None else out, out, m, n, col0, cols,
        K=len(peers), HAS_BIAS=bias is not None, OUT_BF16=_out_bf16(out), BLOCK=block, num_warps=4)
    return out


def gather_peer_columns(peers: list[torch.Tensor], out: torch.Tensor, cols: int) -> torch.Tensor:
    """out[:, j*cols:(j+1)*cols] = peers[j][:, j*cols:(j+1)*cols] for every rank j (peers [M, N], out's dtype)."""
    m, n = out.shape
    numel = m * n
    _gather_columns_kernel[(triton.cdiv(numel, BLOCK),)](*_padded(peers), out, numel, n, cols,
                                                        K=len(peers), BLOCK=BLOCK, num_warps=8)
    return out
