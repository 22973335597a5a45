"""The log-prob a token is reported with: one rule for the rollout engine, the vLLM processor and
the trainer, so that the numbers they compare are computed the same way.

A sampled request (temperature T > 0) reports log_softmax(logits / T)[token]; a greedy one (T = 0)
reports the plain log_softmax(logits)[token], i.e. T = 1.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def logprob_temperature(temperature: float) -> float:
    """The temperature a token's log-prob is taken at: T when sampling, 1 for greedy (T = 0)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    return float(temperature) if temperature > 0 else 1.0


def token_logprobs(logits: torch.Tensor, temperature: float | Sequence[float], tokens: torch.Tensor,
                   log_softmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """float32 log-prob of `tokens` under `logits` [..., V] at the rollout's temperature.

    temperature: one number, or one per row of 2-D logits [N, V] (each mapped by logprob_temperature).
    tokens: logits.shape[:-1]. log_softmax: the canonical one (kernels.log_softmax) unless a fast path
    passes its own.
    """
    from . import log_softmax as canonical_log_softmax, scale_logits

    if isinstance(temperature, (int, float)):
        temps = logprob_temperature(temperature)
    else:
        temps = [logprob_temperature(t) for t in temperature]
    scaled = scale_logits(logits, temps)
    logp = (log_softmax or canonical_log_softmax)(scaled)
    return logp.gather(-1, tokens.unsqueeze(-1).to(logp.device)).squeeze(-1)
