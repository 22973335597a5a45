"""Seeded Gumbel-max sampling with a counter-based hash: no RNG state, no dependence on the batch.

token = argmax over allowed ids of logits / T + g(seed, position, id), g = -log(-log(u)), u from a
32-bit integer hash of (seed, position, id). Greedy (T == 0) is plain argmax. Ties go to the lowest id.
Integer ops and the exact-math log make the noise identical on every device, so any engine that
applies this rule to the same logits picks the same token.
"""
from __future__ import annotations

import numpy as np
import torch

from .backend import backend_for
from .reference import exact_math as em

_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on int64 tensors holding uint32 values (products wrap; low bits kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1), float32 [N, V], a pure function of (seed, position, token id)."""
    seeds = seeds.to(torch.int64).reshape(-1, 1)
    positions = positions.to(torch.int64).reshape(-1, 1)
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64).reshape(1, -1)
    h = _fmix32((ids * 0x9E3779B1 + 0x7F4A7C15) & _MASK32)
    h = _fmix32((h + (positions & _MASK32)) & _MASK32)
    h = _fmix32((h + (seeds & _MASK32)) & _MASK32)
    h = _fmix32((h + ((seeds >> 32) & _MASK32)) & _MASK32)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    triton_ops = _triton_sampling(seeds)
    if triton_ops is not None:
        return triton_ops.gumbel_noise(seeds, positions, vocab_size)
    return -em.log(-em.log(hash_uniform(seeds, positions, vocab_size)))


def _triton_sampling(t: torch.Tensor):
    """kernels.triton.sampling for CUDA tensors when Triton is installed, else None."""
    backend = backend_for(t)
    return getattr(backend, "sampling", None)


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the maximum per row, lowest index on ties (independent of the backend's argmax)."""
    ids = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    top = x.amax(dim=-1, keepdim=True)
    return torch.where(x == top, ids, x.shape[-1]).amin(dim=-1)


def allowed_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool [N, V]: ids kept by top-k then top-p, ranking by value with lower ids first on ties."""
    n, vocab = scaled.shape
    order = torch.sort(scaled, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(vocab, device=scaled.device).expand(n, vocab))
    k = torch.where(top_k > 0, top_k, vocab).reshape(-1, 1)
    keep = rank < k
    probs = em.exp(scaled - scaled.amax(-1, keepdim=True))
    probs = torch.where(keep, probs, 0.0)
    sorted_probs = probs.gather(1, order)
    # mass strictly before each sorted id, in sorted order (sequential prefix sum per row)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    total = em.tree_sum(probs).unsqueeze(-1)
    keep_sorted = before < top_p.reshape(-1, 1).float() * total
    keep_sorted[:, 0] = True
    keep_p = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
    return keep & keep_p


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row of float32 logits [N, V]; per-row temperature (0 = greedy), top_k (<= 0 =
    off), top_p (1.0 = off), seed and absolute position of the token being sampled. The per-row
    values are checked here: pass host tensors to keep the checks free of device syncs."""
    _check_sample_args(logits, temperature, top_k, top_p, seeds, positions)
    return sample_checked(logits, temperature, top_k, top_p, seeds, positions, any_row_masked(top_k, top_p))


def any_row_masked(top_k, top_p) -> bool:
    """Whether some row restricts its ids (top_k > 0 or top_p < 1); numpy arrays or tensors."""
    return bool(((top_k > 0) | (top_p < 1.0)).any())


def check_row_values(temperature: np.ndarray, top_p: np.ndarray, positions: np.ndarray) -> None:
    """sample()'s rules for per-row values (host arrays): ValueError where one is broken."""
    if not (np.isfinite(temperature).all() and (temperature >= 0).all()):
        raise ValueError("temperature must be finite and >= 0 (0 means greedy)")
    if not ((top_p > 0) & (top_p <= 1)).all():
        raise ValueError("top_p must be in (0, 1]")
    if (positions < 0).any():
        raise ValueError("positions must be >= 0")


def sample_checked(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   seeds: torch.Tensor, positions: torch.Tensor, needs_mask: bool) -> torch.Tensor:
    """sample() for per-row values its callers have checked already (rollout_service.engine.sampler.RowParams
    does, on the host), on the host or the device: no check and no device sync here. needs_mask: some
    row has top_k > 0 or top_p < 1."""
    logits = logits.float()
    dev = logits.device

    def to_dev(t, dtype=None):  # host arguments: an async copy, no device sync
        return t.to(dev, dtype, non_blocking=True)
    temperature = to_dev(temperature, torch.float32).reshape(-1, 1)
    greedy = temperature <= 0
    triton_ops = _triton_sampling(logits)
    scaled = None
    if needs_mask or triton_ops is None:
        scaled = logits / torch.where(greedy, 1.0, temperature)  # tensor / tensor: true division (see scale_logits)
    mask = allowed_mask(scaled, to_dev(top_k), to_dev(top_p)) if needs_mask else None
    if triton_ops is not None:  # one fused pass: scale, mask, noise, first argmax
        return triton_ops.gumbel_argmax(logits, temperature.reshape(-1), to_dev(seeds), to_dev(positions), mask)
    if needs_mask:
        scaled = torch.where(mask, scaled, float("-inf"))
    noisy = scaled + gumbel_noise(to_dev(seeds), to_dev(positions), logits.shape[-1])
    return torch.where(greedy.reshape(-1), _first_argmax(scaled), _first_argmax(noisy))


def sampling_position(num_preceding: int) -> int:
    """The position the rule hashes for the token that follows `num_preceding` tokens (prompt + tokens
    generated so far): a token's position is its index in the whole sequence. Every engine and the
    vLLM processor take positions from here."""
    return num_preceding


def sampling_positions(num_preceding: int, count: int) -> list[int]:
    """sampling_position of `count` consecutive tokens (a verify window)."""
    return [sampling_position(num_preceding + j) for j in range(count)]


def _check_sample_args(logits, temperature, top_k, top_p, seeds, positions) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [N, V] tensor, got {tuple(logits.shape)} {logits.dtype}")
    n = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                    ("seeds", seeds), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or t.numel() != n:
            raise ValueError(f"{name} must be a tensor with one entry per row ({n})")
    check_row_values(*(t.detach().to("cpu", torch.float64).numpy() for t in (temperature, top_p, positions)))
