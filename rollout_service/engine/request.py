"""Per-request state inside the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout_service.params import Rollout, RolloutStats, SamplingParams


@dataclass
class Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    arrival: int
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    logprobs: list[float] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is in the cache (always < len(tokens))
    block_ids: list[int] = field(default_factory=list)
    stats: RolloutStats = field(default_factory=RolloutStats)
    finish_reason: str | None = None
    # per committed token its expert ids [moe_layers][k], when params.return_routed_experts; None once a
    # commit came without them (a dense model, the vLLM fast path): a partial record would misalign
    routed_experts: list | None = None
    weight_versions: list[int] = field(default_factory=list)  # per generated token (Engine stamps them)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)
        if self.params.return_routed_experts and self.routed_experts is None:
            self.routed_experts = []

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - self.num_generated

    @property
    def needs_prefill(self) -> bool:
        return len(self.tokens) - self.num_cached > 1 or self.num_generated == 0

    def commit(self, tokens: list[int], logprobs: list[float], max_len: int,
               routing: list | None = None) -> None:
        """Append tokens, stopping at a stop token, max_tokens or the model's length limit.
        routing: per token, the expert ids [moe_layers][k] of the forward row that produced it."""
        if routing is None and tokens:
            self.routed_experts = None
        for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
            self.tokens.append(tok)
            self.logprobs.append(lp)
            if self.routed_experts is not None:
                self.routed_experts.append(routing[i])
            if tok in self.params.stop_token_ids:
                self.finish_reason = "stop"
            elif self.remaining <= 0 or len(self.tokens) >= max_len:
                self.finish_reason = "length"
            if self.finish_reason:
                return

    def stamp(self, version: int) -> None:
        """Tokens committed since the last stamp were produced by weights `version`."""
        self.weight_versions += [version] * (self.num_generated - len(self.weight_versions))

    def to_rollout(self) -> Rollout:
        return Rollout(list(self.prompt), self.tokens[len(self.prompt):], list(self.logprobs),
                       self.finish_reason, None, self.stats,
                       None if self.routed_experts is None else list(self.routed_experts),
                       list(self.weight_versions))
