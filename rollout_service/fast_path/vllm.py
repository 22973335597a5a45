"""vLLM as a fast path, through its public offline API only.

An in-process `vllm.LLM` on the same checkpoint proposes windows of `max_tokens=W` tokens. vLLM runs
greedy (temperature 0) from its own point of view; a V1 logits processor (`LLM(logits_processors=...)`)
applies our seeded Gumbel rule (kernels.sample) to vLLM's logits and leaves only the chosen id finite,
so vLLM's argmax picks exactly the token our rule picks. The finite entry holds
log_softmax(logits / T) at that token, which vLLM returns as the token's log-prob
(`logprobs_mode="processed_logits"`). Per-request seed, temperature, top-k, top-p and the absolute
position of the first proposed token travel in `SamplingParams.extra_args`, either nested
(`extra_args["zerokl"] = {...}`, the offline callers) or flat (`extra_args["zerokl_seed"]`, ...: the
OpenAI server's `vllm_xargs` takes only flat scalar values); the position defaults to the prompt length.

Rollback needs no state: the next window resubmits prompt + committed tokens and prefix caching
reuses the KV. Weights reach vLLM through `worker_extension_cls` + `LLM.collective_rpc`.

`import vllm` happens only when a VLLMFastPath is built (or the processor class is first looked up),
so `import rollout_service` works without vLLM installed.
"""
from __future__ import annotations

import gc
import math
import os
import shutil
import tempfile
from typing import Any

import torch

from kernels.logprobs import token_logprobs
from kernels.sampling import sampling_position

from ..sampler import sample_tokens
from .base import DraftRequest, Proposal

EXTRA_ARGS_KEY = "zerokl"
XARGS_PREFIX = "zerokl_"  # flat keys, e.g. vllm_xargs={"zerokl_seed": 5, "zerokl_temperature": 0.7}
PARAM_NAMES = ("seed", "temperature", "top_k", "top_p", "position")
WORKER_EXTENSION = f"{__name__}.VLLMWorkerExtension"
PROCESSOR_FQCN = f"{__name__}:GumbelLogitsProcessor"
# For `vllm serve`: a request without our params is refused (400) instead of passing through greedy
# with raw logits reported as log-probs.
STRICT_PROCESSOR_FQCN = f"{__name__}:StrictGumbelLogitsProcessor"

# Worker-side capture of what the processor saw (audits and tests); lives in the worker process.
_CAPTURE: dict[str, Any] = {"on": False, "records": []}


def _row_params(cfg: dict, num_output: int) -> tuple[float, int, float, int, int]:
    """cfg["position"]: the prompt's length (tokens before the first generated one)."""
    return (cfg["temperature"], cfg["top_k"], cfg["top_p"], cfg["seed"],
            sampling_position(cfg["position"] + num_output))


def canonical_vllm_params(params, num_preceding: int, max_tokens: int):
    """vLLM SamplingParams that make vLLM emit our rule's tokens and log-probs for a
    rollout_service.SamplingParams request whose first new token follows `num_preceding` tokens."""
    from vllm import SamplingParams as VSamplingParams
    cfg = dict(seed=params.effective_seed, temperature=float(params.temperature), top_k=int(params.top_k),
               top_p=float(params.top_p), position=num_preceding)
    return VSamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False,
                           stop_token_ids=list(params.stop_token_ids) or None, extra_args={EXTRA_ARGS_KEY: cfg})


def completion_tokens(completion) -> tuple[list[int], list[float]]:
    """(token ids, the log-prob vLLM reported for each) of a vLLM CompletionOutput."""
    tokens = list(completion.token_ids)
    return tokens, [completion.logprobs[j][t].logprob for j, t in enumerate(tokens)]


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
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"zerokl temperature must be a finite number >= 0, got {temperature!r}")
    seed = raw.get("seed", sampling_params.seed)
    if seed is None:
        if temperature > 0:
            raise ValueError(f"zerokl temperature > 0 needs a seed ({XARGS_PREFIX}seed or the request's seed)")
        seed = 0
    cfg = dict(temperature=temperature, seed=_number("seed", seed, int),
               top_k=_number("top_k", raw.get("top_k", 0), int),
               top_p=_number("top_p", raw.get("top_p", 1.0), float),
               position=None if raw.get("position") is None else _number("position", raw["position"], int))
    if not 0 <= cfg["seed"] < 2 ** 63:
        raise ValueError(f"zerokl seed must be in [0, 2**63), got {cfg['seed']}")
    if not 0 < cfg["top_p"] <= 1:
        raise ValueError(f"zerokl top_p must be in (0, 1], got {cfg['top_p']}")
    if cfg["position"] is not None and cfg["position"] < 0:
        raise ValueError(f"zerokl position must be >= 0, got {cfg['position']}")
    _check_neutral(sampling_params)
    return cfg


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

        @staticmethod
        def rule(logits, temperature, top_k, top_p, seeds, positions):  # per-row host lists
            return sample_tokens(logits, temperature, top_k, top_p, seeds, positions)

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
            params = [_row_params(self.rows[i][0], len(self.rows[i][1])) for i in index]
            temp, top_k, top_p, seeds, positions = (list(c) for c in zip(*params))
            every_row = len(index) == n  # the usual case: work on vLLM's logits in place, no gather
            rows = logits if every_row else logits[torch.tensor(index, device=logits.device)]
            rows = rows.float()
            tokens = self.rule(rows, temp, top_k, top_p, seeds, positions)  # per-row host lists
            logprobs = token_logprobs(rows, temp, tokens).unsqueeze(1)
            if _CAPTURE["on"]:
                for k in range(len(index)):
                    _CAPTURE["records"].append(dict(
                        temperature=temp[k], top_k=top_k[k], top_p=top_p[k], seed=seeds[k],
                        position=positions[k], logits=rows[k].tolist(),
                        token=int(tokens[k]), logprob=float(logprobs[k])))
            if every_row and rows.data_ptr() == logits.data_ptr():
                logits.fill_(float("-inf")).scatter_(1, tokens.unsqueeze(1), logprobs)
                return logits
            out = torch.full_like(rows, float("-inf")).scatter_(1, tokens.unsqueeze(1), logprobs)
            logits.index_copy_(0, torch.tensor(index, device=logits.device), out.to(logits.dtype))
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


class VLLMWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); reached with `LLM.collective_rpc`."""

    def zerokl_stage_weights(self, named_tensors=None, path: str | None = None) -> int:
        """Tensors by reference (in-process engine) or a safetensors file (worker processes)."""
        if path is not None:
            from safetensors.torch import load_file
            named_tensors = list(load_file(path).items())
        staged = self.__dict__.setdefault("_zerokl_staged", [])
        staged.extend(named_tensors)
        return len(staged)

    def zerokl_commit_weights(self) -> int:
        """Loads the staged (checkpoint-format) weights with vLLM's in-place reload."""
        staged = self.__dict__.pop("_zerokl_staged", [])
        self.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
        return len(staged)

    def zerokl_capture(self, on: bool) -> list[dict]:
        records, _CAPTURE["records"] = _CAPTURE["records"], []
        _CAPTURE["on"] = bool(on)
        return records


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def sized_options(llm_options: dict, gpu_share: float) -> dict:
    """vllm.LLM options with our defaults where the caller set none: on CPU eager mode, blocks of 32
    tokens and a 1 GiB KV cache; on GPU `gpu_share` of the GPU's memory."""
    options = dict(llm_options)
    sized = {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(options)
    if _on_cpu():
        options.setdefault("enforce_eager", True)
        options.setdefault("block_size", 32)  # CPU default 128: prefix reuse is per full block
        if not sized:  # vLLM's CPU default (0.9 of the NUMA node's RAM) rarely fits next to us
            options["kv_cache_memory_bytes"] = 1 << 30
    elif not sized:
        options["gpu_memory_utilization"] = gpu_share
    return options


class VLLMFastPath:
    """FastPath on an in-process vllm.LLM built from the verifier's checkpoint.

    model: a checkpoint directory / hub id, or a Hugging Face model object (saved to a temp dir).
    Options go to vllm.LLM; defaults here: dtype bfloat16, prefix caching on, no tokenizer; on CPU
    eager mode, block_size 32 and a 1 GiB KV cache; on GPU gpu_memory_utilization=0.4 (the verifier
    shares the GPU) unless gpu_memory_utilization or kv_cache_memory_bytes is given.
    `stock_sampler=True`: vLLM's own sampler and log-probs instead of our processor.
    `in_process=True` runs vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0
    before the first LLM, uniprocess executor); vLLM's CPU worker then makes torch.set_num_threads a
    no-op process-wide. `logits_processor`: the processor class (or "module:Class"); the default
    applies kernels.sample. `capture()` records what the processor saw (all LLMs of the process).
    """

    name = "vllm"

    def __init__(self, model, *, max_model_len: int | None = None, dtype: str = "bfloat16",
                 in_process: bool = True, logits_processor=None, seed: int = 0,
                 weight_chunk_bytes: int = 1 << 29, stock_sampler: bool = False, **llm_options):
        self._tmpdir = None
        if isinstance(model, (str, os.PathLike)):
            path = str(model)
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="zerokl-vllm-")
            model.save_pretrained(self._tmpdir)
            path = self._tmpdir
        if in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            llm_options.setdefault("distributed_executor_backend", "uni")
        self.in_process = (os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
                           and llm_options.get("distributed_executor_backend") == "uni")
        llm_options = sized_options(llm_options, gpu_share=0.4)  # the verifier shares the GPU
        from vllm import LLM
        self.weight_chunk_bytes = weight_chunk_bytes
        self.processor = None if stock_sampler else logits_processor or PROCESSOR_FQCN
        sampler = dict(logprobs_mode="processed_logprobs") if stock_sampler else \
            dict(logits_processors=[self.processor], logprobs_mode="processed_logits")
        self.llm = LLM(model=path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                       skip_tokenizer_init=True, enable_prefix_caching=True,
                       worker_extension_cls=WORKER_EXTENSION, **sampler, **llm_options)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    # -- FastPath protocol --------------------------------------------------------------------
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        prompts, params, slots = [], [], []
        proposals = [Proposal([], []) for _ in batch]
        for i, r in enumerate(batch):
            n = min(r.num_tokens, self.max_model_len - len(r.token_ids))
            if n <= 0:
                continue
            prompts.append({"prompt_token_ids": list(r.token_ids)})
            params.append(canonical_vllm_params(r.params, len(r.token_ids), n))
            slots.append(i)
        if not prompts:
            return proposals
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        for i, out in zip(slots, outputs):
            proposals[i] = Proposal(*completion_tokens(out.outputs[0]))
        return proposals

    def release(self, request_id: int) -> None:
        """Nothing to free: vLLM's prefix cache keeps (and evicts) the KV of resubmitted prefixes."""

    def update_weights(self, state_dict) -> None:
        """Load a Hugging Face-named state dict into vLLM's model (vLLM's in-place reload, through
        the worker extension) and drop the prefix-cache KV computed with the old weights."""
        items = state_dict.items() if hasattr(state_dict, "items") else state_dict
        named = []
        for name, tensor in items:
            t = tensor.detach()
            if hasattr(t, "full_tensor"):  # DTensor from FSDP2
                t = t.full_tensor()
            named.append((name, t))
        if self.in_process:
            self.llm.collective_rpc("zerokl_stage_weights", args=(named,))
        else:  # collective_rpc is for control messages: pass files, in chunks
            self._stage_through_files(named)
        self.llm.collective_rpc("zerokl_commit_weights")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    def _stage_through_files(self, named) -> None:
        from safetensors.torch import save_file
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(prefix="zerokl-weights-", dir=shm) as tmp:
            chunk, size, k = {}, 0, 0
            for i, (name, t) in enumerate(named):
                chunk[name] = t.to("cpu", copy=True).contiguous()
                size += t.numel() * t.element_size()
                if size >= self.weight_chunk_bytes or i == len(named) - 1:
                    path = os.path.join(tmp, f"{k}.safetensors")
                    save_file(chunk, path)
                    self.llm.collective_rpc("zerokl_stage_weights", kwargs={"path": path})
                    os.remove(path)
                    chunk, size, k = {}, 0, k + 1

    # -- extras ---------------------------------------------------------------------------------
    def capture(self, on: bool = True) -> list[dict]:
        """Switch recording of (params, position, logits row, chosen token, log-prob) per processed
        row on or off; returns the records kept since the previous call (first worker)."""
        records = self.llm.collective_rpc("zerokl_capture", args=(on,))[0]
        for r in records:  # kept as floats in the worker (plain data crosses processes)
            r["logits"] = torch.tensor(r["logits"], dtype=torch.float32)
        return records

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:  # an in-process engine core frees weights, KV cache and graphs only now
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
