"""Per-token log-probs under the canonical forward (the numbers the rollout engine reports)."""
from __future__ import annotations

import torch

import kernels as K

from .patch import check_input_ids, is_patched, patch_model


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0) -> torch.Tensor:
    """float32 [B, T-1]: log p(input_ids[:, t+1] | input_ids[:, :t+1]) with logits / temperature.

    Right padding (per attention_mask) does not change values at real positions; padded positions
    are 0. Differentiable (canonical forward, ordinary backward). Patches `model` if it is not yet.
    """
    if not isinstance(temperature, (int, float)) or not temperature > 0 or temperature != temperature:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    ids = check_input_ids(model, input_ids)
    if ids.shape[1] < 2:
        raise ValueError("input_ids need at least 2 tokens per row to have a next-token log-prob")
    if attention_mask is not None:
        if attention_mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(ids.shape)}")
        mask = attention_mask.to(ids.device).bool()
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ValueError("attention_mask must be right-padded (1s then 0s per row)")
    if not is_patched(model):
        patch_model(model)
    logits = K.scale_logits(model(input_ids=ids).logits[:, :-1], float(temperature))
    logp = K.log_softmax(logits).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if attention_mask is not None:
        logp = torch.where(mask[:, 1:], logp, 0.0)
    return logp
