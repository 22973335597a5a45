"""The interface between the engine and a fast path (a decoder that proposes tokens cheaply).

A fast path proposes up to n tokens per request with the same seeded sampling rule as the verifier
(kernels.sample); the verifier decides what is committed. `off` requests use the proposals (and their
fast-path log-probs) directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rollout_service.params import SamplingParams


@dataclass
class DraftRequest:
    request_id: int
    token_ids: list[int]  # prompt + committed tokens; the last one has no KV yet (it is fed next)
    params: SamplingParams
    num_tokens: int  # how many tokens to propose (>= 1)
    block_ids: list[int] = field(default_factory=list)  # the engine's paged-KV blocks (native only)
    prompt_len: int = 0
    # record each proposed token's MoE routing: set for proposals committed as they are (`off`,
    # canonical steps) of requests that asked; DVR proposals are replaced by the verifier's
    record_routing: bool = False


@dataclass
class Proposal:
    token_ids: list[int]
    logprobs: list[float]  # fast-path log_softmax(logits / T) at each token (T=1 when greedy)
    # per token the expert ids [moe_layers][k] of the row that produced it; None: not recorded
    # (no request asked, a dense model, or a fast path that cannot record routing)
    routing: list | None = None


class FastPath(Protocol):
    name: str

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        """Proposals for a batch; token j of request r is sampled at absolute position
        len(r.token_ids) + j with seed r.params.seed."""

    def release(self, request_id: int) -> None:
        """Forget any state kept for a finished or rolled back request."""

    def update_weights(self, state_dict) -> None:
        """Load new weights (fast paths that hold their own copy)."""
