"""What a train step measures besides its loss: the agreement of its forwards with the rollouts (log-probs,
and MoE routing), and the spread of the importance ratio."""
from __future__ import annotations

import math

import torch

from .metrics import logprob_agreement, routing_agreement


def routing_out(mb: dict) -> list | None:
    """A list for the forward's MoE routing when the rollouts recorded theirs, else None."""
    return [] if "rollout_routed_experts" in mb else None


def rollout_agreement(mb: dict, logp: torch.Tensor, routing: list | None, behaviour=None) -> dict:
    """Log-prob (and, for MoE rollouts, routing) agreement of one forward with the rollouts; rows of an
    older weight version from `behaviour` (log-probs, rows), that version's forward."""
    if behaviour is not None:
        stale_logp, tokens = behaviour
        logp = torch.where(tokens, stale_logp, logp)
    part = logprob_agreement(mb["rollout_logprobs"], logp.cpu(), mb["loss_mask"])
    if routing is not None:  # per layer [B, T, k] -> [B, T-1, layers, k], aligned like the log-probs
        train = torch.stack(routing, dim=2)[:, :-1].cpu()
        part.update(routing_agreement(mb["rollout_routed_experts"], train, mb["loss_mask"]))
    return part


class RatioSpread:
    """The importance ratio exp(log-prob - old log-prob) over a step's loss tokens: min, mean, max. Kept on
    the device and read once per step (no host sync per micro-batch)."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []  # per micro-batch: [min, max, sum, count]

    def add(self, logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> None:
        ratio, mask = (logp - old).exp().double(), mask.bool()
        self.parts.append(torch.stack([torch.where(mask, ratio, math.inf).min(),
                                       torch.where(mask, ratio, -math.inf).max(),
                                       torch.where(mask, ratio, 0.0).sum(), mask.sum().double()]))

    def summary(self) -> dict:
        if not self.parts:
            return {"min": math.inf, "max": -math.inf, "sum": 0.0, "count": 0}
        parts = torch.stack(self.parts).cpu()
        return {"min": float(parts[:, 0].min()), "max": float(parts[:, 1].max()), "sum": float(parts[:, 2].sum()),
                "count": int(parts[:, 3].sum())}
