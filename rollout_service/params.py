"""Request and result types shared by the engine, the Ray service and the recipes."""
from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from dataclasses import dataclass, field

DETERMINISM_MODES = ("verified", "invariant", "off")


class InvalidRequestError(ValueError):
    """A request that can never be served (bad params, bad token ids, prompt too long...)."""


def token_id_list(prompt) -> list[int]:
    """A prompt as a list of Python ints: any sequence of integers (list, tuple, numpy array or
    integer tensor, numpy integer scalars included). Floats and bools are refused."""
    if hasattr(prompt, "tolist"):  # numpy arrays, torch tensors (float or bool ones fail below)
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequestError(f"prompt must be a sequence of int token ids, got {type(prompt).__name__}")
    if all(type(t) is int for t in prompt):  # the common case, without the slower ABC checks below
        return list(prompt)
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):  # numpy bools are not Integral
            raise InvalidRequestError(f"prompt must hold int token ids, got {type(t).__name__} {t!r}")
    return [int(t) for t in prompt]


def check_prompt(prompt, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as token ids every engine can serve, or InvalidRequestError saying why not."""
    prompt = token_id_list(prompt)
    if not prompt:
        raise InvalidRequestError("prompt is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        raise InvalidRequestError(f"prompt has token ids outside [0, {vocab_size}): {bad[:5]}")
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(f"prompt has {len(prompt)} tokens; max_model_len is {max_model_len}")
    return prompt


def check_params(params) -> SamplingParams:
    """Validated params; an unseeded sampled request (determinism "off") draws its own seed, as vLLM
    does, so n samples of one prompt differ."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if params.seed is None and not params.greedy:
        params = dataclasses.replace(params, seed=secrets.randbits(63))
    return params


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    determinism: str = "verified"
    # record each generated token's MoE expert ids (Rollout.routed_experts); the name is vLLM's
    return_routed_experts: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        def bad(msg):
            raise InvalidRequestError(f"invalid SamplingParams: {msg}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.determinism not in DETERMINISM_MODES:
            bad(f"determinism must be one of {DETERMINISM_MODES}, got {self.determinism!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63):
            bad(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if self.seed is None and not self.greedy and self.determinism != "off":
            bad(f"a sampled request (temperature={self.temperature}) with determinism="
                f"{self.determinism!r} needs a seed")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if not isinstance(self.return_routed_experts, bool):
            bad(f"return_routed_experts must be a bool, got {self.return_routed_experts!r}")

    @property
    def effective_seed(self) -> int:
        # None only reaches the sampler for greedy requests, which ignore it (the engine gives
        # unseeded sampled requests a fresh seed)
        return 0 if self.seed is None else self.seed


@dataclass
class RolloutStats:
    verify_windows: int = 0
    rollbacks: int = 0
    recomputed_tokens: int = 0  # proposals the verifier recomputed and rejected
    proposed_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class Rollout:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"
    error: str | None = None
    stats: RolloutStats = field(default_factory=RolloutStats)
    # with SamplingParams(return_routed_experts=True) on an MoE model: per generated token, the expert
    # ids [moe_layers][k] (increasing ids) of the forward row whose logits produced it (row
    # prompt_len + i - 1 for token i, the row the trainer scores it at). None when not asked for, for a
    # dense model, or where the engine cannot record it (proposals of the vLLM fast path).
    routed_experts: list[list[list[int]]] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")
