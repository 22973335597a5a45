"""The log-prob a token is reported with: one rule for the rollout engine, the vLLM processor and
the trainer, so that the numbers they compare are computed the same way.

A sampled request (temperature T > 0) reports log_softmax(logits / T)[token]; a greedy one (T = 0)
reports the plain log_softmax(logits)[token], i.e. T = 1. The canonical log_softmax and the
temperature division live here too.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .backend import backend_for
from .backward import head_logprobs_with_grad, with_reference_grad


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Canonical float32 log-softmax over the last dim."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.numel() == 0:
        raise ValueError(f"x is empty (shape {tuple(x.shape)})")
    if x.dtype != torch.float32:
        raise TypeError(f"log_softmax takes float32 logits, got {x.dtype}")
    impl = backend_for(x).log_softmax
    return with_reference_grad(impl, lambda a: torch.log_softmax(a, dim=-1), x)


_canonical_log_softmax = log_softmax  # token_logprobs' default (its argument shadows the name)


def scale_logits(logits: torch.Tensor, temperature) -> torch.Tensor:
    """logits / temperature by true IEEE division (temperature: a number, or one per row).

    The one place temperature is applied: on CUDA, `tensor / python_float` is computed as a multiply
    by the reciprocal, which differs in the last bit from dividing by a tensor.
    """
    t = torch.as_tensor(temperature, dtype=torch.float32).to(logits.device, non_blocking=True)
    t = t.reshape(-1, *([1] * (logits.dim() - 1))) if t.numel() > 1 else t.reshape([1] * logits.dim())
    return logits / t


def logprob_temperature(temperature):
    """The temperature a token's log-prob is taken at: T when sampling, 1 for greedy (T = 0). A
    tensor of per-row values (checked >= 0 by its maker) is mapped where it lies, without a sync."""
    if isinstance(temperature, torch.Tensor):
        return torch.where(temperature > 0, temperature, 1.0)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    return float(temperature) if temperature > 0 else 1.0


def token_logprobs(logits: torch.Tensor, temperature: float | Sequence[float] | torch.Tensor, tokens: torch.Tensor,
                   log_softmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """float32 log-prob of `tokens` under `logits` [..., V] at the rollout's temperature.

    temperature: one number, or one per row of 2-D logits [N, V] (each mapped by logprob_temperature);
    a float32 tensor of per-row values >= 0 (checked by its maker) is mapped where it lies, no sync.
    tokens: logits.shape[:-1]. log_softmax: the canonical one (kernels.log_softmax) unless a fast path
    passes its own.
    """
    if isinstance(temperature, (int, float, torch.Tensor)):
        temps = logprob_temperature(temperature)
    else:
        temps = [logprob_temperature(t) for t in temperature]
    fused = getattr(backend_for(logits), "token_log_softmax", None)
    if (fused is not None and log_softmax is None and logits.dtype == torch.float32 and logits.dim() == 2
            and not (torch.is_grad_enabled() and logits.requires_grad)):
        # the rollout side on GPU: the same bits without the scaled logits or the [N, V] output
        t = torch.as_tensor(temps, dtype=torch.float32).to(logits.device, non_blocking=True)
        return fused(logits, t.expand(logits.shape[0]), tokens.to(logits.device))
    scaled = scale_logits(logits, temps)
    logp = (log_softmax or _canonical_log_softmax)(scaled)
    return logp.gather(-1, tokens.unsqueeze(-1).to(logp.device)).squeeze(-1)


HEAD_CHUNK_ROWS = 2048  # rows per chunk in head_token_logprobs: 2048 x Qwen's 151,936 fp32 logits = 1.2 GB


def mask_vocab_tail(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """logits with the columns >= vocab_limit set to -inf (None: unchanged), out of place.

    The rule of a rollout that forbids the ids a padded embedding has past its tokenizer's last token
    (verl's vLLM rollout does, before sampling and before the log-prob): the log-softmax then runs over the
    same [rows, V] float32 tensor with -inf there, so the same kernel gives the same bits on both sides."""
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    if vocab_limit < 1:
        raise ValueError(f"vocab_limit must be >= 1, got {vocab_limit}")
    cols = torch.arange(logits.shape[-1], device=logits.device)
    return logits.masked_fill(cols >= vocab_limit, float("-inf"))


def head_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, tokens: torch.Tensor, *,
                        entropy: bool = False, chunk_rows: int = HEAD_CHUNK_ROWS, vocab_limit: int | None = None):
    """Log-probs of `tokens` through the lm head, for the rows being scored only: per row the bits of
    token_logprobs(matmul(hidden, weight, out_dtype=float32), temperature, tokens), computed a chunk of rows
    at a time, so that no [rows, V] logits of more than one chunk exist (as TRL's fused lm head does).

    hidden [N, H] bf16, weight [V, H] bf16, tokens [N]; temperature: one number (greedy 0: log-probs at 1).
    Returns (log-probs [N] float32, entropies [N] or None). entropy: also each row's entropy at the same
    temperature, by ordinary torch math and without gradient (a metric). Differentiable in hidden and weight
    (kernels.backward._HeadTokenLogprobs: the ordinary backward, logits recomputed a chunk at a time).
    vocab_limit: ids >= vocab_limit are forbidden (mask_vocab_tail), in the log-probs, the entropies and the
    gradient; a scored token there raises.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if tokens.shape != hidden.shape[:1]:
        raise ValueError(f"tokens must be [N] = {hidden.shape[0]}, got {tuple(tokens.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if vocab_limit is not None and tokens.numel() and bool((tokens >= vocab_limit).any()):
        raise ValueError(f"a scored token id is >= vocab_limit={vocab_limit}, an id the rollout cannot sample")
    t = logprob_temperature(float(temperature))
    matmul = backend_for(hidden).matmul

    def score_chunk(h, tok, want_entropy):
        logits = mask_vocab_tail(matmul(h, weight, None, segments=1, out_dtype=torch.float32), vocab_limit)
        logp = token_logprobs(logits, t, tok)
        if not want_entropy:
            return logp, None
        kept = logits if vocab_limit is None else logits[:, :vocab_limit]  # 0 * -inf would be nan
        lsm = torch.log_softmax(scale_logits(kept, t), dim=-1)
        return logp, -(lsm.exp() * lsm).sum(-1)

    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if entropy else None)
    return head_logprobs_with_grad(score_chunk, hidden, weight, tokens.to(hidden.device), t, chunk_rows, entropy,
                                   vocab_limit)
