"""Reference canonical ops: plain torch, any device, invariant by construction.

Every per-row result is a fixed sequence of correctly rounded operations on that row's own inputs:
reductions run in a fixed order (sequential over K for matmul, fixed trees elsewhere) that does not
depend on how many rows are computed together, where a row sits, or how a sequence is chunked.
Slow (a Python loop over K), which is fine for tests, tiny models and as the oracle for GPU kernels.
"""
from __future__ import annotations

import torch

from ..contract import REFERENCE, check_attention_blocks
from ..lora import per_member
from . import exact_math as em


def matmul_partials(x: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    """fp32 [segments, M, N]: segment s = sum over its K slice, k = lo, lo+1, ... in order.

    x [M, K], weight [N, K] (nn.Linear layout), bf16 values. bf16 x bf16 products are exact in fp32,
    so fused or unfused multiply-add gives the same bits; one rounding per step.
    """
    k_dim = x.shape[-1]
    xt = x.float().t().contiguous()  # [K, M]: column k of x is contiguous
    wt = weight.float().t().contiguous()  # [K, N]: row k is contiguous for the rank-1 update
    seg_len = -(-k_dim // segments)
    out = torch.zeros(segments, xt.shape[1], wt.shape[1], dtype=torch.float32, device=x.device)
    for s in range(segments):
        acc = out[s]
        for k in range(s * seg_len, min((s + 1) * seg_len, k_dim)):
            acc.addcmul_(xt[k].unsqueeze(1), wt[k:k + 1])
    return out


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           segments: int = 1, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x @ weight.T (+ bias), x [..., K]: K in `segments` equal segments (each in order), the
    partials combined by a fixed binary tree, then the bias added."""
    parts = matmul_partials(x.reshape(-1, x.shape[-1]), weight, segments)
    out = em.tree_combine(list(parts.unbind(0)))
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], weight.shape[0]).to(out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = em.tree_sum(xf * xf) / xf.shape[-1]
    inv = 1.0 / torch.sqrt(var + eps)
    y = (xf * inv.unsqueeze(-1)).to(torch.bfloat16)
    return (weight.float() * y.float()).to(torch.bfloat16)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    z = xf - xf.amax(dim=-1, keepdim=True)
    return z - em.log(em.tree_sum(em.exp(z))).unsqueeze(-1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return (g * em.sigmoid(g) * up.float()).to(torch.bfloat16)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Paged cache [NB, BS, H, D] + block table [B, nb] -> contiguous [B, num_blocks * BS, H, D]."""
    blocks = cache[block_table[:, :num_blocks].long()]
    return blocks.reshape(block_table.shape[0], -1, *cache.shape[2:])


def merge_split_state(total, split):
    """Merge a split's online-softmax state (max, denominator, accumulator) into the running total;
    an empty split (max -inf) leaves the total exactly as it was, and the first one is taken as is."""
    m_tot, den_tot, acc_tot = total
    m_s, den_s, acc_s = split
    m_new = torch.maximum(m_tot, m_s)

    def weight(m):  # exp(m - m_new), exactly 1 where m is the max and 0 where m is -inf
        return torch.where(m == m_new, 1.0, torch.where(torch.isinf(m), 0.0, em.exp(m - m_new)))
    a, b = weight(m_tot), weight(m_s)
    return m_new, den_s * b + den_tot * a, acc_s * b.unsqueeze(-1) + acc_tot * a.unsqueeze(-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              block_table: torch.Tensor | None = None, scale: float | None = None,
              block_kv: int = REFERENCE.attention_block_kv,
              split_kv: int = REFERENCE.attention_split_kv) -> torch.Tensor:
    """Causal GQA attention where query (b, t) at positions[b, t] sees keys 0..positions[b, t] of b.

    q [B, T, Hq, D]. Contiguous KV: k, v [B, L, Hkv, D], key j at position j. Paged KV: k, v
    [NB, BS, Hkv, D] with block_table [B, nb]. Negative positions mark padding rows (output 0).
    KV is cut into splits of `split_kv` positions from 0; within a split, blocks of `block_kv`
    positions run an fp32 online softmax from a fresh state, and the splits' states are merged in
    order (merge_split_state). Blocks or splits with no visible key leave a row's state untouched, so
    extra ones (a longer neighbour) change nothing.
    """
    check_attention_blocks(block_kv, split_kv)
    bsz, tq, hq, d = q.shape
    max_pos = int(positions.max().item()) if positions.numel() else -1
    n_keys = max_pos + 1
    if block_table is not None:
        bs = k.shape[1]
        nb = -(-n_keys // bs)
        k, v = gather_kv(k, block_table, nb), gather_kv(v, block_table, nb)
    k, v = k[:, :n_keys], v[:, :n_keys]
    hkv = k.shape[2]
    heads = torch.arange(hq, device=q.device) // (hq // hkv)
    n_pad = -(-max(n_keys, 1) // block_kv) * block_kv
    pad = (0, 0, 0, 0, 0, n_pad - k.shape[1])
    # head-major, contiguous layouts so every rank-1 update below is a dense broadcast
    kt = torch.nn.functional.pad(k.float(), pad).index_select(2, heads).permute(0, 2, 3, 1).contiguous()  # B,H,D,L
    vf = torch.nn.functional.pad(v.float(), pad).index_select(2, heads).transpose(1, 2).contiguous()  # B,H,L,D
    # keys beyond a sequence's last query position may be stale cache contents: never read them
    row_max = positions.amax(dim=1)
    vf = torch.where((torch.arange(n_pad, device=q.device)[None, :] <= row_max[:, None])[:, None, :, None], vf, 0.0)
    qf = q.float().transpose(1, 2).contiguous()  # B,H,T,D
    pos = positions[:, None, :, None]  # B,1,T,1
    scale = d ** -0.5 if scale is None else scale

    scores = torch.zeros(bsz, hq, tq, n_pad, dtype=torch.float32, device=q.device)
    for j in range(d):
        scores.addcmul_(qf[..., j:j + 1], kt[:, :, j:j + 1, :])
    scores = scores * scale

    def fresh():  # an online-softmax state with no key seen: (max, denominator, accumulator)
        return (torch.full((bsz, hq, tq), float("-inf"), device=q.device),
                torch.zeros(bsz, hq, tq, device=q.device), torch.zeros(bsz, hq, tq, d, device=q.device))
    total, (m, denom, acc) = fresh(), fresh()
    key_pos = torch.arange(n_pad, device=q.device)
    for start in range(0, n_pad, block_kv):
        if start and start % split_kv == 0:  # a new split: fold the last one in, start afresh
            total = merge_split_state(total, (m, denom, acc))
            m, denom, acc = fresh()
        visible = key_pos[start:start + block_kv] <= pos  # [B, 1, T, Bk]
        s = torch.where(visible, scores[..., start:start + block_kv], float("-inf"))
        any_visible = visible.any(-1)  # [B, 1, T]
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.where(torch.isinf(m), 0.0, em.exp(m - m_new))
        p = torch.where(visible, em.exp(s - m_new.unsqueeze(-1)), 0.0)
        new_denom = denom * alpha + em.tree_sum(p)
        pb = p.to(torch.bfloat16).float()
        pv = torch.zeros_like(acc)
        for j in range(block_kv):
            pv.addcmul_(pb[..., j:j + 1], vf[:, :, start + j:start + j + 1, :])
        new_acc = acc * alpha.unsqueeze(-1) + pv
        m = torch.where(any_visible, m_new, m)
        denom = torch.where(any_visible, new_denom, denom)
        acc = torch.where(any_visible.unsqueeze(-1), new_acc, acc)
    _, denom, acc = merge_split_state(total, (m, denom, acc))
    out = acc / torch.where(denom > 0, denom, 1.0).unsqueeze(-1)
    out = (out + 0.0).transpose(1, 2)  # + 0.0: canonical sign of zero; back to [B, T, H, D]
    return torch.where((positions >= 0)[..., None, None], out, 0.0).to(torch.bfloat16)


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     block_table: torch.Tensor, query_start: torch.Tensor, query_len: torch.Tensor,
                     max_query_len: int, out: torch.Tensor, scale: float | None = None,
                     block_kv: int = REFERENCE.attention_block_kv,
                     split_kv: int = REFERENCE.attention_split_kv) -> torch.Tensor:
    """Paged attention for B sequences whose queries lie back to back in one flat batch: sequence b's
    are rows query_start[b] .. query_start[b] + query_len[b] - 1 of q [N, Hq, D] (positions [N]), its
    keys behind block_table[b]. Writes those rows of out [N, Hq, D] (the others are left as they are)
    with the numbers `attention` gives them in the padded [B, max_query_len] layout."""
    offsets = torch.arange(max_query_len, device=q.device)
    valid = offsets[None, :] < query_len[:, None]
    rows = query_start[:, None] + torch.minimum(offsets[None, :], query_len[:, None] - 1)  # clamped inside
    o = attention(q[rows], k, v, torch.where(valid, positions[rows], -1), block_table, scale, block_kv, split_kv)
    out[rows[valid]] = o[valid]
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, T, H, D] bf16, cos/sin [B, T, D/2] fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(torch.bfloat16)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() + b.float()).to(torch.bfloat16)


def lora_add(base: torch.Tensor, product: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """base + bf16(product * scale) on the rows of mask (every row if None), base elsewhere: the product scaled
    and rounded to bf16, then the canonical add. Rows mask leaves out are base itself, selected rather than
    added to a zero (-0.0 + 0.0 would flip a sign bit)."""
    added = add(base, torch.mul(product, scale))
    return added if mask is None else torch.where(mask.unsqueeze(-1), added, base)


def lora_expand_add(base: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float,
                    mask: torch.Tensor | None, widths: tuple[int, ...] | None = None) -> torch.Tensor:
    """lora_add(base, matmul(h, b), scale, mask): a LoRA term's expand and epilogue (one launch on GPU). With
    `widths`, the terms of a projection group side by side: member j's columns of base and rows of b, and its
    rank-r block j of h."""
    return per_member(lambda x, hj, bj: lora_add(x, matmul(hj, bj), scale, mask), base, h, b,
                      tuple(widths or (base.shape[-1],)))


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_pool[blocks[n], offsets[n]] = k[n] (and v): token n's [Hkv, D] into a paged cache (strided views allowed)."""
    k_pool[blocks, offsets] = k.to(k_pool.dtype)
    v_pool[blocks, offsets] = v.to(v_pool.dtype)
