"""Canonical float32 log-softmax over the last dim.

A row of V values is cut into fixed chunks of CHUNK = min(4096, next_pow2(V)) columns (a function of V
only). Pass 1 gives each chunk's (max, sum of exp(x - max)); pass 2 combines a row's chunk results in
one fixed order (every program of the row computes the same bits) and writes its chunk. Chunks run in
parallel, so a few rows with a 128k vocabulary still fill the GPU.

token_log_softmax gives one entry per row, log_softmax(x / t)[token], with the same bits: the same
chunk statistics (x / t by correctly rounded division, as torch divides by a tensor) and the same
combination, without writing the scaled logits or the [N, V] output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_CHUNK = 4096


@triton.jit
def _store_chunk_stats(x, m_ptr, s_ptr, row, c, C):
    """A chunk's (max, sum of exp(x - max)); masked columns hold -inf."""
    mx = tl.max(x, axis=0)
    e = tl.where(x == float("-inf"), 0.0, tl.exp(x - mx))
    tl.store(m_ptr + row * C + c, mx)
    tl.store(s_ptr + row * C + c, tl.sum(e, axis=0))


@triton.jit
def _row_max_log_sum(m_ptr, s_ptr, row, C, BLOCK_C: tl.constexpr):
    """A row's max and log of its sum of exp(x - max), from its chunk statistics in chunk order."""
    ci = tl.arange(0, BLOCK_C)
    mc = tl.load(m_ptr + row * C + ci, mask=ci < C, other=float("-inf"))
    sc = tl.load(s_ptr + row * C + ci, mask=ci < C, other=0.0)
    mx = tl.max(mc, axis=0)
    w = tl.where(mc == float("-inf"), 0.0, tl.exp(mc - mx))
    return mx, tl.log(tl.sum(sc * w, axis=0))


@triton.jit(do_not_specialize=["M"])
def _chunk_stats_kernel(x_ptr, m_ptr, s_ptr, M, V, C, stride_xm, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < V, other=float("-inf"))
    _store_chunk_stats(x, m_ptr, s_ptr, row, c, C)


@triton.jit(do_not_specialize=["M"])
def _log_softmax_kernel(x_ptr, m_ptr, s_ptr, out_ptr, M, V, C, stride_xm, stride_om,
                        CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    mx, log_sum = _row_max_log_sum(m_ptr, s_ptr, row, C, BLOCK_C)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_om + cols, (x - mx) - log_sum, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _scaled_chunk_stats_kernel(x_ptr, t_ptr, m_ptr, s_ptr, M, V, C, stride_xm, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < V, other=float("-inf"))
    x = tl.math.div_rn(x, tl.zeros_like(x) + tl.load(t_ptr + row))
    _store_chunk_stats(x, m_ptr, s_ptr, row, c, C)


@triton.jit(do_not_specialize=["M"])
def _token_log_softmax_kernel(x_ptr, t_ptr, tok_ptr, m_ptr, s_ptr, out_ptr, M, C, stride_xm,
                              BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    mx, log_sum = _row_max_log_sum(m_ptr, s_ptr, row, C, BLOCK_C)
    x = tl.load(x_ptr + row * stride_xm + tl.load(tok_ptr + row))
    x = tl.math.div_rn(x, tl.load(t_ptr + row))
    tl.store(out_ptr + row, (x - mx) - log_sum)


def _layout(v: int) -> tuple[int, int]:
    """(chunk width, warps): a function of V only."""
    chunk = min(_MAX_CHUNK, max(16, triton.next_power_of_2(v)))
    return chunk, 8 if chunk >= 2048 else 4


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    v = x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    chunk, warps = _layout(v)
    c = triton.cdiv(v, chunk)
    stats_m = torch.empty(m, c, dtype=torch.float32, device=x.device)
    stats_s = torch.empty(m, c, dtype=torch.float32, device=x.device)
    out = torch.empty(m, v, dtype=torch.float32, device=x.device)
    _chunk_stats_kernel[(m, c)](x2, stats_m, stats_s, m, v, c, x2.stride(0), CHUNK=chunk, num_warps=warps)
    _log_softmax_kernel[(m, c)](x2, stats_m, stats_s, out, m, v, c, x2.stride(0), out.stride(0),
                                CHUNK=chunk, BLOCK_C=max(2, triton.next_power_of_2(c)), num_warps=warps)
    return out.reshape(x.shape)


def token_log_softmax(x: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [N]: log_softmax(x[n] / temperature[n])[tokens[n]] for float32 rows x [N, V], with the
    bits of log_softmax(x / temperature[:, None]).gather(1, tokens[:, None]) (arguments on x's device)."""
    v = x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    chunk, warps = _layout(v)
    c = triton.cdiv(v, chunk)
    temperature = temperature.to(torch.float32).contiguous()
    stats_m = torch.empty(m, c, dtype=torch.float32, device=x.device)
    stats_s = torch.empty(m, c, dtype=torch.float32, device=x.device)
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    _scaled_chunk_stats_kernel[(m, c)](x2, temperature, stats_m, stats_s, m, v, c, x2.stride(0), CHUNK=chunk,
                                       num_warps=warps)
    _token_log_softmax_kernel[(m,)](x2, temperature, tokens.to(torch.int64).contiguous(), stats_m, stats_s, out,
                                    m, c, x2.stride(0), BLOCK_C=max(2, triton.next_power_of_2(c)), num_warps=warps)
    return out
