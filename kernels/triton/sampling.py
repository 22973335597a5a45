"""Seeded Gumbel-max sampling in one pass over the logits (see kernels.sampling for the rule).

The hash is the same uint32 murmur finaliser and the log the same sequence of IEEE-rounded
operations as kernels.reference.exact_math.log, launched with FP contraction off (no FMA) and
correctly rounded division, so the noise is bit-identical to the CPU's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048
_NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _u32(x):
    return x.to(tl.uint32)  # keeps the low 32 bits, whatever width the product was promoted to


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = _u32(h * 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _u32(h * 0xC2B2AE35)
    return h ^ (h >> 16)


@triton.jit
def _exact_log(x):
    tiny = x < 1.1754943508222875e-38
    xs = tl.where(tiny, x * 16777216.0, x)
    bits = xs.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - tl.where(tiny, 24, 0)
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > 1.4142135623730951
    m = tl.where(big, m * 0.5, m)
    e = (e + big.to(tl.int32)).to(tl.float32)
    f = m - 1.0
    s = tl.math.div_rn(f, f + 2.0)
    z = s * s
    poly = tl.zeros_like(z) + 2.0 / 11.0
    poly = poly * z + 2.0 / 9.0
    poly = poly * z + 2.0 / 7.0
    poly = poly * z + 2.0 / 5.0
    poly = poly * z + 2.0 / 3.0
    log_m = s * 2.0 + s * (z * poly)
    out = e * 0.693145751953125 + (log_m + e * 1.4286068203094172e-06)
    out = tl.where(x == 0, float("-inf"), out)
    return out  # inputs here are in (0, 1) or (0, inf): no inf / negative cases


@triton.jit
def _noise(seed_lo, seed_hi, pos_lo, ids):
    h = _fmix32(_u32(ids.to(tl.uint32) * 0x9E3779B1 + 0x7F4A7C15))
    h = _fmix32(_u32(h + pos_lo))
    h = _fmix32(_u32(h + seed_lo))
    h = _fmix32(_u32(h + seed_hi))
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -_exact_log(-_exact_log(u))


@triton.jit
def _row_keys(seeds_ptr, pos_ptr, row):
    seed = tl.load(seeds_ptr + row)
    pos = tl.load(pos_ptr + row)
    return _u32(seed), _u32(seed >> 32), _u32(pos)  # low word, high word (arithmetic shift), low word


@triton.jit
def _noise_kernel(seeds_ptr, pos_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed_lo, seed_hi, pos_lo = _row_keys(seeds_ptr, pos_ptr, row)
    g = _noise(seed_lo, seed_hi, pos_lo, cols)
    tl.store(out_ptr + row.to(tl.int64) * V + cols, g, mask=cols < V)


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, seeds_ptr, pos_ptr, mask_ptr, best_ptr, best_id_ptr, V, stride,
                   n_blocks, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, block of ids): the maximum of logits/T + noise (greedy rows: of logits) and its first
    id; masked ids are -inf. Blocks run in parallel; gumbel_argmax picks the first best block."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    greedy = temp <= 0
    div = tl.where(greedy, 1.0, temp)
    seed_lo, seed_hi, pos_lo = _row_keys(seeds_ptr, pos_ptr, row)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + cols, mask=ok, other=float("-inf"))
    x = tl.math.div_rn(x, tl.zeros_like(x) + div)
    if HAS_MASK:
        keep = tl.load(mask_ptr + row.to(tl.int64) * V + cols, mask=ok, other=0) != 0
        x = tl.where(keep, x, float("-inf"))
    if not greedy:
        x = x + _noise(seed_lo, seed_hi, pos_lo, cols)
    x = tl.where(ok, x, float("-inf"))
    out = row.to(tl.int64) * n_blocks + blk
    tl.store(best_ptr + out, tl.max(x, axis=0))
    tl.store(best_id_ptr + out, (blk * BLOCK + tl.argmax(x, axis=0, tie_break_left=True)).to(tl.int64))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    n = seeds.numel()
    out = torch.empty(n, vocab_size, dtype=torch.float32, device=seeds.device)
    _noise_kernel[(n, triton.cdiv(vocab_size, BLOCK_V))](
        seeds.to(torch.int64).contiguous(), positions.to(seeds.device, torch.int64).contiguous(), out, vocab_size,
        BLOCK=BLOCK_V, **_NO_FMA)
    return out


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [N]: the sampling rule over float32 logits [N, V] (arguments already on the device).

    Every (row, block) program finds its block's maximum and first id; the row's token is the id of
    the first block holding the row maximum. Exact comparisons only, so the split does not change
    which id wins (the lowest among equal maxima), and rows keep the whole GPU busy.
    """
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_blocks = triton.cdiv(vocab, BLOCK_V)
    best = torch.empty(n, n_blocks, dtype=torch.float32, device=logits.device)
    best_id = torch.empty(n, n_blocks, dtype=torch.int64, device=logits.device)
    _sample_kernel[(n, n_blocks)](
        logits, temperature.to(torch.float32).contiguous(), seeds.to(torch.int64).contiguous(),
        positions.to(torch.int64).contiguous(), mask if mask is not None else logits, best, best_id, vocab,
        logits.stride(0), n_blocks, HAS_MASK=mask is not None, BLOCK=BLOCK_V, **_NO_FMA)
    blocks = torch.arange(n_blocks, device=logits.device).expand(n, n_blocks)
    first = torch.where(best == best.amax(dim=1, keepdim=True), blocks, n_blocks).amin(dim=1)
    return best_id.gather(1, first.clamp_max(n_blocks - 1).unsqueeze(1)).squeeze(1)
