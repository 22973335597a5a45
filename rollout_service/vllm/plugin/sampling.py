"""Our sampling rule inside vLLM: the per-request parameters and what applies them to vLLM's logits.

vLLM runs greedy (temperature 0) from its own point of view. Our seeded Gumbel rule (kernels.sample)
picks each row's token from the canonical float32 logits and leaves only that id finite, so vLLM's
argmax picks exactly it; the token's log-prob is kernels.logprobs.token_logprobs at our temperature.
Two carriers, one per model runner (vllm_plugin.runner_options picks):

- vLLM's V1 model runner: GumbelLogitsProcessor (`LLM(logits_processors=...)`); the finite entry
  holds the log-prob, which vLLM reports with `logprobs_mode="processed_logits"`;
- the V2 model runner (no V1-style processors): the model's own sampler (vllm.plugin.runner_v2)
  applies the same `canonical_rows`.

Per-request seed, temperature, top-k, top-p and the absolute position of the first generated token
travel in `SamplingParams.extra_args`, either nested (`extra_args["zerokl"] = {...}`, the offline
callers) or flat (`extra_args["zerokl_seed"]`, ...: the OpenAI server's `vllm_xargs` takes only flat
scalar values); the position defaults to the prompt length.

The processor classes subclass vLLM's, so they are built on first lookup: importing this module
does not import vLLM.
"""
from __future__ import annotations

import copy
import secrets
from collections import OrderedDict
from typing import Any

import torch

from kernels.logprobs import token_logprobs
from kernels.sampling import sampling_position
from rollout_service.engine.sampler import RowParams, sample_with_logprobs
from rollout_service.params import InvalidRequestError, check_sampling

EXTRA_ARGS_KEY = "zerokl"
XARGS_PREFIX = "zerokl_"  # flat keys, e.g. vllm_xargs={"zerokl_seed": 5, "zerokl_temperature": 0.7}
PARAM_NAMES = ("seed", "temperature", "top_k", "top_p", "position")
PROCESSOR_FQCN = f"{__name__}:GumbelLogitsProcessor"
# For `vllm serve`: a request without our params is refused (400) instead of passing through greedy
# with raw logits reported as log-probs.
STRICT_PROCESSOR_FQCN = f"{__name__}:StrictGumbelLogitsProcessor"

# Worker-side capture of what the rule saw (audits and tests); lives in the worker process.
CAPTURE: dict[str, Any] = {"on": False, "records": []}


def rows_from_configs(cfgs: list[dict], num_outputs) -> RowParams:
    """RowParams of rows with params cfgs[k] that have generated num_outputs[k] tokens so far
    (cfg["position"]: the tokens before the first generated one, i.e. the prompt's length)."""
    return RowParams.from_values([c["temperature"] for c in cfgs], [c["top_k"] for c in cfgs],
                                 [c["top_p"] for c in cfgs], [c["seed"] for c in cfgs],
                                 [sampling_position(c["position"] + n) for c, n in zip(cfgs, num_outputs)])


def canonical_rows(rows: torch.Tensor, params: RowParams, rule=None, graphs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probs) of our rule (`rule`: a stand-in for tests) for float32 logits rows with
    per-row `params`, without a device sync; replayed from `graphs` (rollout_service.vllm.sampler_graphs)
    where they cover the rows. Both carriers (V1 processor, V2 sampler) call this."""
    if rule is not None:
        tokens = rule(rows, params)
        logprobs = token_logprobs(rows, torch.from_numpy(params.temperature), tokens)
    elif graphs is not None and graphs.covers(rows, params):
        tokens, logprobs = graphs(rows, params)
    else:
        tokens, logprobs = sample_with_logprobs(rows, params)
    if CAPTURE["on"]:
        for k in range(len(params)):
            CAPTURE["records"].append(dict(
                temperature=float(params.temperature[k]), top_k=int(params.top_k[k]),
                top_p=float(params.top_p[k]), seed=int(params.seed[k]), position=int(params.position[k]),
                logits=rows[k].tolist(), token=int(tokens[k]), logprob=float(logprobs[k])))
    return tokens, logprobs


def keep_only(logits: torch.Tensor, rows_at: torch.Tensor | None, tokens: torch.Tensor,
              values: torch.Tensor) -> None:
    """In place: vLLM's logits rows `rows_at` (None: every row, the usual case, no gather) become
    -inf except at `tokens`, which hold `values`; vLLM's temperature-0 sampler then picks `tokens`."""
    values = values.to(logits.dtype).unsqueeze(1)
    if rows_at is None:
        logits.fill_(float("-inf")).scatter_(1, tokens.unsqueeze(1), values)
    else:
        chosen = torch.full((len(tokens), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        logits.index_copy_(0, rows_at, chosen.scatter_(1, tokens.unsqueeze(1), values))


def _number(name: str, value, kind):
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"zerokl {name} must be a number, got {value!r}")
    try:
        out = kind(value)
        if kind is int and isinstance(value, float) and value != out:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"zerokl {name} must be {'an int' if kind is int else 'a number'}, "
                         f"got {value!r}") from None
    return out


def request_params(sampling_params) -> dict | None:
    """Our per-request params from vLLM SamplingParams, or None where the request carries none.

    Nested `extra_args["zerokl"]` and flat `extra_args["zerokl_<name>"]` (flat wins). Required:
    temperature (0 = greedy); seed when temperature > 0 (else the request's own `seed` field; greedy
    defaults to 0). Defaults: top_k 0 (off), top_p 1.0, position None (= the prompt length).
    Raises ValueError (vLLM answers 400) for malformed values or vLLM settings that would change the
    chosen token or its log-prob.
    """
    extra = sampling_params.extra_args or {}
    nested = extra.get(EXTRA_ARGS_KEY)
    flat = {k[len(XARGS_PREFIX):]: v for k, v in extra.items() if k.startswith(XARGS_PREFIX)}
    if nested is None and not flat:
        return None
    if nested is not None and not isinstance(nested, dict):
        raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] must be a dict, got {type(nested).__name__}")
    raw = {**(nested or {}), **flat}
    unknown = set(raw) - set(PARAM_NAMES)
    if unknown:
        raise ValueError(f"unknown zerokl params {sorted(unknown)}; known: {list(PARAM_NAMES)}")
    if "temperature" not in raw:
        raise ValueError(f"zerokl params need a temperature ({XARGS_PREFIX}temperature, 0 = greedy)")
    temperature = _number("temperature", raw["temperature"], float)
    seed = raw.get("seed", sampling_params.seed)
    if seed is None and temperature > 0:
        raise ValueError(f"zerokl temperature > 0 needs a seed ({XARGS_PREFIX}seed or the request's seed)")
    try:  # the same rule as SamplingParams (top_k -1 or 0: off)
        temperature, top_k, top_p, seed = check_sampling(
            temperature, _number("top_k", raw.get("top_k", 0), int), _number("top_p", raw.get("top_p", 1.0), float),
            None if seed is None else _number("seed", seed, int))
    except InvalidRequestError as e:
        raise ValueError(f"zerokl {e}") from None
    cfg = dict(temperature=temperature, seed=0 if seed is None else seed, top_k=top_k, top_p=top_p,
               position=None if raw.get("position") is None else _number("position", raw["position"], int))
    if cfg["position"] is not None and cfg["position"] < 0:
        raise ValueError(f"zerokl position must be >= 0, got {cfg['position']}")
    _check_neutral(sampling_params)
    return cfg


# The seed each recent request sampled with, by its request id, in the process where requests enter
# the engine (a vllm.LLM's, or the server's frontend): a request without a seed gets a fresh one, and
# seed_of gives it back so the rollout can be replayed. Bounded: the oldest entries go first.
SEEDS_KEPT = 1 << 16
_seeds: OrderedDict[str, int] = OrderedDict()


def seed_of(request_id: str) -> int | None:
    """The seed a recent request to the canonical model sampled with (its sample i: seed + i), by the
    request id vLLM reports (RequestOutput.request_id); None for an unknown or long-gone request, or
    one whose zerokl fields set the seed themselves."""
    return _seeds.get(str(request_id))


def canonical_request(sampling_params, request_id: str | None = None):
    """The one rule for what a request to the canonical model samples with (compat.install_request_rule
    applies it to every request as it enters the engine, with the request's id).

    - zerokl fields (nested or flat extra_args): they decide, as request_params reads them.
    - Otherwise vLLM's / OpenAI's own fields: temperature, top_k, top_p and seed become our params, on
      a copy whose vLLM temperature is 0 (vLLM then picks and reports our token untouched; at its own
      temperature it would divide the reported log-prob). A request without a seed gets a fresh one,
      as vLLM would draw; `n` samples take seed + index (vLLM's fan-out), so they differ and repeat.
    Raises ValueError (the server's 400) for anything that would change the canonical token or its
    log-prob: min_p, penalties, a logit bias, banned or allowed ids, min_tokens, bad values."""
    if request_params(sampling_params) is not None:
        return sampling_params
    sp = sampling_params
    if sp.min_p:
        raise ValueError(f"min_p={sp.min_p} would change the canonical token or log-prob; not supported")
    seed = secrets.randbelow(1 << 62) if sp.seed is None else sp.seed
    if isinstance(seed, int) and seed + sp.n > 2 ** 63:
        raise ValueError(f"seed must leave room for n={sp.n} samples (seed + n <= 2**63), got {seed}")
    # a shallow copy (the caller's params stay as they are), copied shallowly by vLLM too: a deep copy
    # re-runs SamplingParams' checks, which refuse n > 1 at temperature 0
    out = copy.copy(sp)
    out.extra_args = {**(sp.extra_args or {}),
                      EXTRA_ARGS_KEY: {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p}}
    out.temperature, out.top_k, out.top_p, out.min_p, out.seed = 0.0, 0, 1.0, 0.0, seed
    out.skip_clone = True
    request_params(out)  # the checks a zerokl request gets
    if request_id is not None:
        _seeds[str(request_id)] = seed
        _seeds.move_to_end(str(request_id))
        while len(_seeds) > SEEDS_KEPT:
            _seeds.popitem(last=False)
    return out


def _check_neutral(sp) -> None:
    """vLLM must pick our token by argmax and report our value untouched: temperature 0, and none of
    the built-in logits changes that run before (bias, bans, min_tokens) or after (penalties) ours."""
    if sp.temperature != 0:
        raise ValueError("the seeded Gumbel processor needs vLLM temperature=0 (the sampling temperature "
                         f"goes in {XARGS_PREFIX}temperature), got temperature={sp.temperature}")
    changes = dict(repetition_penalty=sp.repetition_penalty != 1.0, presence_penalty=sp.presence_penalty != 0,
                   frequency_penalty=sp.frequency_penalty != 0, min_tokens=sp.min_tokens > 0,
                   logit_bias=bool(sp.logit_bias), allowed_token_ids=bool(sp.allowed_token_ids),
                   bad_words=bool(sp.bad_words))
    bad = [name for name, on in changes.items() if on]
    if bad:
        raise ValueError(f"{bad} would change the canonical token or log-prob; not supported with zerokl params")

def _build_processor_class():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class GumbelLogitsProcessor(LogitsProcessor):
        """Applies the seeded Gumbel rule to rows whose SamplingParams.extra_args carry our params;
        other rows pass through untouched."""

        rule = None  # the seeded Gumbel rule; tests set a stand-in (logits, RowParams) -> tokens

        require_params = False  # StrictGumbelLogitsProcessor: refuse requests without our params

        @classmethod
        def validate_params(cls, sampling_params):
            if request_params(sampling_params) is None and cls.require_params:
                raise ValueError(
                    f"this server samples with the zerokl rule: send vllm_xargs={{\"{XARGS_PREFIX}temperature\": T, "
                    f"\"{XARGS_PREFIX}seed\": S}} (optional {XARGS_PREFIX}top_k, {XARGS_PREFIX}top_p, "
                    f"{XARGS_PREFIX}position) and temperature=0")

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.rows: dict[int, tuple[dict, list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, prompt_ids, output_ids in batch_update.added:
                cfg = request_params(params)  # validated at admission: does not raise here
                if cfg is None:
                    self.rows.pop(index, None)
                    continue
                if cfg["position"] is None:
                    if prompt_ids is None:  # prompt embeddings: no ids to count
                        raise ValueError(f"zerokl: a request without token ids needs {XARGS_PREFIX}position")
                    # the prompt as submitted: preemption keeps it (recomputed outputs stay in output_ids)
                    cfg["position"] = len(prompt_ids)
                self.rows[index] = (cfg, output_ids)
            for a, b, direction in batch_update.moved:
                entry_a, entry_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if entry_a is not None:
                    self.rows[b] = entry_a
                if direction == MoveDirectionality.SWAP and entry_b is not None:
                    self.rows[a] = entry_b

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.rows:
                return logits
            n = logits.shape[0]
            index = sorted(i for i in self.rows if i < n)
            if not index:
                return logits
            rows_at = None if len(index) == n else torch.tensor(index, device=logits.device)
            rows = (logits if rows_at is None else logits[rows_at]).float()
            params = rows_from_configs([self.rows[i][0] for i in index], [len(self.rows[i][1]) for i in index])
            tokens, logprobs = canonical_rows(rows, params, rule=self.rule)
            keep_only(logits, rows_at, tokens, logprobs)  # processed_logits: the finite entry is reported
            return logits

    class StrictGumbelLogitsProcessor(GumbelLogitsProcessor):
        """GumbelLogitsProcessor that refuses (400 from the server) requests without our params."""
        require_params = True

    for cls in (GumbelLogitsProcessor, StrictGumbelLogitsProcessor):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return GumbelLogitsProcessor, StrictGumbelLogitsProcessor


def __getattr__(name: str):
    # The processors subclass vLLM's LogitsProcessor, so they are built on first use (this also serves
    # vLLM's "module:Class" lookup and pickling by reference in spawned workers).
    if name in ("GumbelLogitsProcessor", "StrictGumbelLogitsProcessor"):
        if "GumbelLogitsProcessor" not in globals():
            base, strict = _build_processor_class()
            globals().update(GumbelLogitsProcessor=base, StrictGumbelLogitsProcessor=strict)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

