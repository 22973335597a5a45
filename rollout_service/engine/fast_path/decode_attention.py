"""Split-KV decode attention over the paged cache (CUDA, Triton): the native fast path's decode kernel.

Not canonical: the key range of a sequence is cut into SPLIT-key pieces reduced by separate programs
and merged by their log-sum-exp, which is fast for long contexts and small batches but makes the
numbers depend on the split. The verifier never uses it. The number of splits follows the block
table's width, not the sequences' lengths, so no host sync is needed and the launch can be captured
in a CUDA graph; pieces past a sequence's length return at once, and the merge reads only the pieces
a sequence has (a table sized for max_model_len would otherwise cost a full-width partials write and
read per layer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT = 256  # keys per program
BLOCK_N = 64  # keys per step inside a program
_LOG2E = 1.4426950408889634


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, o_ptr, lse_ptr, G, HKV, BS, qk_scale,
                    sq_b, sq_h, sk_page, sk_pos, sk_h, sv_page, sv_pos, sv_h, sp_b, st_b, so_b, so_h, so_s,
                    sl_b, sl_h, SPLIT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    n_keys = tl.load(pos_ptr + b * sp_b).to(tl.int32) + 1  # keys 0..position (padding rows: none)
    start = split * SPLIT
    if start >= n_keys:
        return  # a piece past the sequence's end: the merge does not read it
    kvh = bh % HKV
    r = tl.arange(0, BLOCK_H)
    h = kvh * G + r
    hmask = r < G
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    end = tl.minimum(start + SPLIT, n_keys)
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + d[None, :], mask=hmask[:, None] & dmask[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        ok = j < end
        page = tl.load(table_ptr + b * st_b + j // BS, mask=ok, other=0).to(tl.int64)
        slot = (j % BS).to(tl.int64)
        kvmask = ok[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (page * sk_page + slot * sk_pos + kvh * sk_h)[:, None] + d[None, :], mask=kvmask,
                    other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        v = tl.load(v_ptr + (page * sv_page + slot * sv_pos + kvh * sv_h)[:, None] + d[None, :], mask=kvmask,
                    other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m_i = m_new
    has = l_i > 0
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * so_b + h[:, None] * so_h + split * so_s + d[None, :], o,
             mask=hmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + b * sl_b + h * sl_h + split, lse, mask=hmask)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, pos_ptr, out_ptr, HQ, NSPLIT, so_b, so_h, so_s, sl_b, sl_h, sp_b, sout_b,
                  sout_h, SPLIT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    idx = tl.program_id(0)
    b = (idx // HQ).to(tl.int64)
    h = idx % HQ
    s = tl.arange(0, BLOCK_S)
    n_keys = tl.load(pos_ptr + b * sp_b).to(tl.int32) + 1
    smask = (s < NSPLIT) & (s * SPLIT < n_keys)  # the pieces that hold keys
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    lse = tl.load(lse_ptr + b * sl_b + h * sl_h + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.math.exp2(lse - top)  # empty pieces: 0
    o = tl.load(o_ptr + b * so_b + h * so_h + s[:, None] * so_s + d[None, :], mask=smask[:, None] & dmask[None, :],
                other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * sout_b + h * sout_h + d, out.to(tl.bfloat16), mask=dmask)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, positions: torch.Tensor,
                     block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, 1, Hq, D], pools [blocks, BS, Hkv, D], positions [B, 1]
    (keys 0..position are attended; position -1 gives zeros), block_table [B, max_blocks] -> [B, 1, Hq, D]."""
    bsz, _, hq, dim = q.shape
    _, bs, hkv, _ = k_pool.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    g = hq // hkv
    nsplit = triton.cdiv(block_table.shape[1] * bs, SPLIT)
    part = torch.empty(bsz, hq, nsplit, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, hq, nsplit, dtype=torch.float32, device=q.device)
    out = torch.empty(bsz, 1, hq, dim, dtype=torch.bfloat16, device=q.device)
    block_d = max(16, triton.next_power_of_2(dim))
    _partial_kernel[(bsz * hkv, nsplit)](
        q, k_pool, v_pool, positions, block_table, part, lse, g, hkv, bs, float(scale) * _LOG2E,
        q.stride(0), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), positions.stride(0), block_table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        SPLIT=SPLIT, D=dim, BLOCK_D=block_d, BLOCK_H=max(16, triton.next_power_of_2(g)), BLOCK_N=BLOCK_N,
        num_warps=4, num_stages=2)
    _merge_kernel[(bsz * hq,)](
        part, lse, positions, out, hq, nsplit, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
        lse.stride(1), positions.stride(0), out.stride(0), out.stride(2), SPLIT=SPLIT, D=dim, BLOCK_D=block_d,
        BLOCK_S=max(2, triton.next_power_of_2(nsplit)), num_warps=4)
    return out
