"""Typed configuration of an engine and of a worker's parallel layout: every option, its default and
its check, in one place.

`Engine(model, EngineConfig(...))` or `Engine(model, window=8, ...)` (keywords build the config);
an unknown option or a bad value fails here, once, with the option's name. A worker's
`engine_kwargs` are engine options plus the ParallelConfig fields (`split_worker_options`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rollout_service.engine.decode_policy import VERIFIED_DECODE


@dataclass(frozen=True)
class EngineConfig:
    """The native engine's options: decode-verify-rollback (DVR), KV cache, scheduling and device."""
    fast_path: Any = "native"
    """Who proposes tokens for DVR (and decodes `off` requests): "native", "vllm" or a FastPath object."""
    window: int = 16
    """W: tokens proposed per request before a verify (>= 1)."""
    group: int = 64
    """G: verify windows per canonical forward, and the most requests prefilled per step (>= 1)."""
    device: str = "cpu"
    """The torch device the model, the KV cache and every forward run on (e.g. "cpu", "cuda")."""
    block_size: int = 16
    """KV cache page, in tokens (>= 1)."""
    kv_cache_tokens: int = 65536
    """KV cache capacity in tokens, rounded up to whole pages (>= 1); a request that cannot fit is refused."""
    max_num_seqs: int = 256
    """Most requests running at once; the rest wait (>= 1)."""
    max_prefill_tokens: int = 4096
    """Prefill token budget per step (>= 1)."""
    max_model_len: int | None = None
    """Longest prompt + max_tokens a request may have (>= 2); None: the model's max_position_embeddings."""
    copy_model: bool = True
    """Deep-copy a model object handed in (False: the engine may cast it)."""
    fast_path_options: dict = field(default_factory=dict)
    """Keyword options of the "vllm" fast path (its VLLMInstance); unused by the native one."""
    cuda_graphs: bool = True
    """On CUDA: replay decode steps and verify windows from graphs."""
    verified_decode: str = "auto"
    """How `verified` decodes: "auto" times DVR and canonical steps and keeps the cheaper, "dvr" always
    proposes and verifies (canonical steps on every request: determinism="invariant")."""
    max_lora_rank: int = 64
    """The largest LoRA rank load_adapter accepts (vLLM's option of the same name)."""
    # Options every engine takes (VLLMEngine too), so that a caller asks for them without knowing which
    # engine a worker runs; each engine does what they mean for it.
    stock_only: bool = False
    """Serve `off` requests only (a stock-numerics run's workers); other requests are refused. The
    native engine's `off` is its fast path alone already."""
    sleep_mode: bool = False
    """Built for sleep() to release GPU memory, where the engine can (capabilities().sleep). The native
    engine allocates its KV cache and graphs once and keeps them: nothing to build differently."""
    max_loras: int = 0
    """LoRA adapters a vLLM engine runs in one step (vLLM's option); 0: it serves none. The native engine
    serves any number, whatever this says."""
    lora_settings: dict | None = None
    """Where a vLLM engine replays CUDA graphs, the settings of the adapters it will serve (LoraAdapter.settings:
    r, alpha, target_modules), sized before capture. The native engine needs none."""

    def __post_init__(self):
        for name in ("window", "group", "block_size", "kv_cache_tokens", "max_num_seqs", "max_prefill_tokens",
                     "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"EngineConfig.max_loras must be an int >= 0, got {self.max_loras!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"EngineConfig.max_model_len must be an int >= 2 or None, got {self.max_model_len!r}")
        if self.verified_decode not in VERIFIED_DECODE:
            hint = ("; canonical steps for every token are the request mode SamplingParams(determinism='invariant')"
                    if self.verified_decode == "canonical" else "")
            raise ValueError(f"EngineConfig.verified_decode must be one of {VERIFIED_DECODE}, "
                             f"got {self.verified_decode!r}{hint}")
        for name in ("stock_only", "sleep_mode"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.fast_path_options, dict):
            raise TypeError(f"EngineConfig.fast_path_options must be a dict, got {type(self.fast_path_options).__name__}")

    @classmethod
    def build(cls, config: EngineConfig | None = None, **options) -> EngineConfig:
        """`config` (default: all defaults) with `options` replaced; unknown names are a TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(known)}")
        if options.get("fast_path_options") is None:
            options.pop("fast_path_options", None)
        return dataclasses.replace(config or cls(), **options)


BACKENDS = ("auto", "native", "vllm")


@dataclass(frozen=True)
class ParallelConfig:
    """How a RolloutWorker runs its engine: which engine (`backend`: "auto" is vLLM running the
    canonical forward where vLLM is installed and the worker holds a GPU per rank, the native engine
    otherwise) over how many devices. `tensor_parallel_size` > 1: vLLM's own tensor parallelism
    inside the worker (its actor holds that many GPUs: resources_per_worker={"num_gpus": k}), or for
    the native engine a group of rank actors."""
    tensor_parallel_size: int = 1
    """The engine's tensor-parallel degree (>= 1): vLLM's own TP, or a group of native rank actors."""
    backend: str = "auto"
    """Which engine the worker runs: "auto", "native" or "vllm" (BACKENDS)."""

    def __post_init__(self):
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


def split_worker_options(options: dict | None) -> tuple[ParallelConfig, dict]:
    """A worker's engine_kwargs -> (its ParallelConfig, the engine's own options)."""
    options = dict(options or {})
    names = [f.name for f in dataclasses.fields(ParallelConfig)]
    parallel = ParallelConfig(**{n: options.pop(n) for n in names if n in options})
    return parallel, options


__all__ = ["BACKENDS", "EngineConfig", "ParallelConfig", "VERIFIED_DECODE", "split_worker_options"]
