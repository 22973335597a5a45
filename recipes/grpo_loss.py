"""The GRPO objective: group-normalised advantages and the clipped policy-gradient loss."""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P, n] (n samples of each prompt) -> advantages [P, n]: reward minus the group mean,
    divided by the group's standard deviation when `scale` (a group with one reward gets 0)."""
    rewards = rewards.double()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.float()


# Corrections for a rollout whose log-probs are not the trainer's (the stock pipeline), on the ratio
# r = exp(old - rollout) of the trainer's old log-prob over the rollout engine's, per token:
#   tis         truncated importance sampling: each token's loss times min(r, cap) (Yao et al. 2025, "Your
#               efficient RL framework secretly brings you off-policy RL training"; verl's rollout_is, token);
#   token_mask  token-level masking: tokens with r outside [1/cap, cap] leave the loss (verl's rollout_rs in
#               token mode, the masked form of Liu et al. 2025's MIS); the others keep weight 1.
# With canonical numerics r is exactly 1 on every token, so either leaves the loss unchanged.
ROLLOUT_CORRECTIONS = ("none", "tis", "token_mask")


def rollout_correction(kind: str, old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float
                       ) -> torch.Tensor | None:
    """Per-token loss weights [B, L] for `kind` (ROLLOUT_CORRECTIONS), no gradient; None for "none"."""
    if kind == "none":
        return None
    ratio = torch.exp(old_logp.detach().float() - rollout_logp.float())
    if kind == "tis":
        return ratio.clamp(max=cap)
    if kind == "token_mask":
        return ((ratio >= 1.0 / cap) & (ratio <= cap)).float()
    raise ValueError(f"rollout correction must be one of {ROLLOUT_CORRECTIONS}, got {kind!r}")


def clipped_pg_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    clip_low: float, clip_high: float, token_weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over masked tokens of the PPO-clipped surrogate (to minimise), and how many tokens clipped.

    logp, old_logp, mask: [B, L]; advantages: [B] (one per sequence, shared by its tokens) or [B, L] (per
    token: packed rows hold several sequences). token_weights [B, L] (rollout_correction) scale each
    token's surrogate.
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    mask = mask.to(per_token.dtype)
    if token_weights is not None:
        per_token = per_token * token_weights.to(per_token.dtype)
    was_clipped = ((clipped > unclipped).to(per_token.dtype) * mask).sum()
    return (per_token * mask).sum(), was_clipped.detach()
