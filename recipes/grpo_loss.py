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


def clipped_pg_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over masked tokens of the PPO-clipped surrogate (to minimise), and how many tokens clipped.

    logp, old_logp, mask: [B, L]; advantages: [B] (one per sequence, shared by its tokens) or [B, L] (per
    token: packed rows hold several sequences).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    mask = mask.to(per_token.dtype)
    was_clipped = ((clipped > unclipped).to(per_token.dtype) * mask).sum()
    return (per_token * mask).sum(), was_clipped.detach()
