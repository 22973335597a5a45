"""Request and result types shared by the engine, the Ray service and the recipes."""
from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from dataclasses import dataclass, field
from enum import Enum


class Determinism(str, Enum):
    """A request's determinism mode (README, "Modes"). A str, so "off" and Determinism.OFF are equal and
    SamplingParams takes either; validate() stores the member."""
    VERIFIED = "verified"  # DVR or canonical steps, whichever is faster: the trainer's bits
    INVARIANT = "invariant"  # a canonical step for every token: the same bits
    OFF = "off"  # the fast path alone: no guarantee

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value) -> Determinism:
        """`value` (a member or its string: "verified", "invariant", "off") as a member; ValueError
        naming the modes otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"must be one of {', '.join(m.value for m in cls)}, got {value!r}") from None

    @property
    def runs_canonical(self) -> bool:
        """Its tokens and log-probs are the canonical forward's, the trainer's bits (all but off)."""
        return self is not Determinism.OFF

    @property
    def verifies(self) -> bool:
        """Decoded by fast-path proposals that the canonical forward verifies (DVR), where the decode
        policy finds that cheaper than canonical steps; counted in RolloutStats' verify windows."""
        return self is Determinism.VERIFIED


DETERMINISM_MODES = tuple(m.value for m in Determinism)


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


def check_request(prompt, params, vocab_size: int, max_model_len: int) -> tuple[list[int], SamplingParams]:
    """A request every engine can serve in full, or InvalidRequestError saying why not: the prompt's
    checks, the params' checks, and room for max_tokens (no engine cuts a request short silently;
    vLLM's server refuses the same request)."""
    prompt = check_prompt(prompt, vocab_size, max_model_len)
    params = check_params(params)
    if len(prompt) + params.max_tokens > max_model_len:
        raise InvalidRequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                  f"max_model_len {max_model_len}")
    return prompt, params


def check_sampling(temperature, top_k, top_p, seed) -> tuple[float, int, float, int | None]:
    """The one check of the sampling values (SamplingParams, the vLLM plugin's params, the server):
    temperature a finite number >= 0 (0 = greedy); top_k an int, -1 or 0 = off (vLLM takes both),
    else >= 1; top_p in (0, 1]; seed None or an int in [0, 2**63). Returns them with top_k's "off"
    as -1; raises InvalidRequestError naming the field."""
    def number(name, value, kind):
        if isinstance(value, bool) or not isinstance(value, kind):
            raise InvalidRequestError(f"{name} must be {'an int' if kind is int else 'a number'}, got {value!r}")
        return value
    number("temperature", temperature, (int, float))
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    number("top_k", top_k, int)
    if top_k < -1:
        raise InvalidRequestError(f"top_k must be -1 or 0 (off) or >= 1, got {top_k!r}")
    number("top_p", top_p, (int, float))
    if not 0 < top_p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (number("seed", seed, int) < 0 or seed >= 2 ** 63):
        raise InvalidRequestError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return float(temperature), (-1 if top_k == 0 else int(top_k)), float(top_p), seed


def check_batch(prompts, params) -> None:
    """The error contract of every batch call (Engine.generate, RolloutClient.generate, the pool):

    - a call that is not a batch of requests raises TypeError / ValueError at once: prompts that are
      not a list of token-id sequences, params that are not SamplingParams (which check their own
      values when made), mismatched lengths, duplicate request ids;
    - each request of a well-formed call that the model cannot serve (ids outside the vocabulary, an
      empty prompt, prompt + max_tokens beyond max_model_len: check_request), or that fails while
      served, comes back as a Rollout with finish_reason "error" and `error` saying why, and the
      other requests are served. Check `r.ok`.

    The OpenAI server answers the second kind with a 400 per request."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) and not hasattr(prompts, "tolist"):
        raise TypeError(f"prompts must be a list of prompts, each a list of token ids; got {type(prompts).__name__}")
    if len(prompts) and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise TypeError("prompts must be a list of prompts, each a list of token ids; got one list of ints "
                        "(for a single prompt pass [prompt])")
    many = params if isinstance(params, (list, tuple)) else [params]
    bad = [type(p).__name__ for p in many if not isinstance(p, SamplingParams)]
    if bad:
        raise TypeError(f"params must be a SamplingParams or a list of them, got {bad[0]}")


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
    determinism: Determinism | str = Determinism.VERIFIED
    # record each generated token's MoE expert ids (Rollout.routed_experts); the name is vLLM's
    return_routed_experts: bool = False
    # the LoRA adapter this request runs with, by the name the engine loaded it under; None: the base model
    adapter: str | None = None

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
        try:
            _, top_k, _, _ = check_sampling(self.temperature, self.top_k, self.top_p, self.seed)
        except InvalidRequestError as e:
            bad(str(e))
        object.__setattr__(self, "top_k", top_k)  # off is -1 here, whether -1 or 0 was given
        try:
            object.__setattr__(self, "determinism", Determinism.parse(self.determinism))
        except ValueError as e:
            bad(f"determinism {e}")
        if self.seed is None and not self.greedy and self.determinism.runs_canonical:
            bad(f"a sampled request (temperature={self.temperature}) with determinism="
                f"{self.determinism!r} needs a seed")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if not isinstance(self.return_routed_experts, bool):
            bad(f"return_routed_experts must be a bool, got {self.return_routed_experts!r}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            bad(f"adapter must be a non-empty adapter name or None, got {self.adapter!r}")

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
    # prompt tokens whose KV the engine took from its prefix cache instead of computing them (engines with
    # capabilities().prefix_cache: vLLM workers); 0 elsewhere
    cached_prompt_tokens: int = 0


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
    # per generated token, the version of the weights that produced it; every token's log-prob is the
    # trainer's under that version over the whole prefix. From a pool: its count of adopted pushes (0: the
    # weights it started with); one version per rollout unless a push switched it in flight
    # (service/switch_modes.py). From a native Engine alone: its weight_version (0 for the weights it was
    # built with, then what each update_weights set). None where the engine does not record it
    # (VLLMEngine used directly).
    weight_versions: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")
