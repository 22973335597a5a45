"""A LoRA term's expand and epilogue in one launch: lora_add(base, matmul(h, b), scale, mask), the same bits.

The product is the canonical matmul's own tile loop (matmul._segment_sum: one fixed order of BLOCK_K tiles
from k = 0, fp32 accumulation), rounded to bf16 as matmul rounds its output; the epilogue is
elementwise._lora_add_kernel's arithmetic on that tile. So each output element goes through the same
operations in the same order as the two launches it replaces, while the [rows, N] product never reaches
memory. A projection group's terms (q/k/v, gate/up: one input, one adapter, one rank) go in one launch too:
each output tile belongs to one member, whose block of h it reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lora import per_member
from .elementwise import _NO_FMA, rows_2d
from .matmul import BLOCK_K, _segment_sum, _tile_ids

MAX_MEMBERS = 3  # q, k and v


@triton.jit(do_not_specialize=["M"])
def _lora_expand_add_kernel(h_ptr, b_ptr, base_ptr, mask_ptr, out_ptr, M, N, N1, N2, R, scale,
                            stride_hm, stride_hk, stride_bn, stride_bk, stride_base, stride_out,
                            HAS_MASK: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # the member whose columns this tile holds (members start on tile boundaries): its rank-R block of h
    member = (pid_n * BLOCK_N >= N1).to(tl.int64) + (pid_n * BLOCK_N >= N2).to(tl.int64)
    # out-of-range rows/cols read a valid row (results discarded), as matmul._mm_kernel does
    ld_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    ld_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    acc = _segment_sum(h_ptr + member * R * stride_hk, b_ptr, ld_m, ld_n, 0, R, R, stride_hm, stride_hk,
                       stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    prod = acc.to(tl.bfloat16).to(tl.float32)  # matmul's bf16 output
    delta = (prod * scale).to(tl.bfloat16)  # lora_add: the scaled product rounded to bf16, then added
    rows = offs_m.to(tl.int64)
    inside = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    base = tl.load(base_ptr + rows[:, None] * stride_base + offs_n[None, :], mask=inside, other=0.0)
    added = (base.to(tl.float32) + delta.to(tl.float32)).to(tl.bfloat16)
    if HAS_MASK:
        keep = tl.load(mask_ptr + rows, mask=offs_m < M, other=0) != 0
        added = tl.where(keep[:, None], added, base)
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], added, mask=inside)


def _block_n(starts: list[int]) -> int | None:
    """The widest column tile (128 down to 16) on whose boundaries every member starts; None if none."""
    return next((bn for bn in (128, 64, 32, 16) if all(s % bn == 0 for s in starts)), None)


def lora_expand_add(base: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float, mask: torch.Tensor | None,
                    widths: tuple[int, ...] | None = None) -> torch.Tensor:
    """kernels.reference.lora_expand_add in one launch: base [..., N] (strided rows are fine), h [..., members * r]
    (a column block of a larger product is fine), b [N, r], mask [...] bool or None; a new [..., N] bf16 tensor."""
    widths = tuple(widths or (base.shape[-1],))
    r = b.shape[-1]
    if (base.shape[:-1] != h.shape[:-1] or tuple(b.shape) != (base.shape[-1], r) or sum(widths) != base.shape[-1]
            or h.shape[-1] != len(widths) * r or (mask is not None and tuple(mask.shape) != tuple(base.shape[:-1]))):
        raise ValueError(f"lora_expand_add: base {tuple(base.shape)}, h {tuple(h.shape)}, b {tuple(b.shape)}, widths "
                         f"{widths} and mask {None if mask is None else tuple(mask.shape)}")
    starts = [sum(widths[:j]) for j in range(1, len(widths))]
    block_n = _block_n(starts)
    if len(widths) > MAX_MEMBERS or block_n is None:  # one launch per member
        return per_member(lambda x, hj, bj: lora_expand_add(x, hj, bj, scale, mask), base, h, b, widths)
    n = base.shape[-1]
    n1, n2 = (starts + [n, n])[:2]
    base2, h2 = rows_2d(base), h.reshape(-1, h.shape[-1])
    m = base2.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=base.device)
    m1 = base2 if mask is None else mask.reshape(-1).contiguous()  # any pointer when there is no mask
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64  # a tile shape does not change an element's reduction
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _lora_expand_add_kernel[grid](h2, b, base2, m1, out, m, n, n1, n2, r, float(scale), h2.stride(0), h2.stride(1),
                                  b.stride(0), b.stride(1), base2.stride(0), out.stride(0),
                                  HAS_MASK=mask is not None, EVEN_K=r % BLOCK_K == 0, BLOCK_M=block_m,
                                  BLOCK_N=block_n, BLOCK_K=BLOCK_K, GROUP_M=8, num_warps=4, num_stages=2, **_NO_FMA)
    return out.reshape(base.shape)
