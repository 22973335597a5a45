"""What a rollout engine next to a colocated trainer rank holds on their shared GPU, while the rank trains
and awake."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from .config import RecipeConfig
from .memory_terms import GiB
from .model_shape import BF16, ModelShape
from .rollouts import engines_sleep

# A vLLM engine asleep (level 2) keeps its CUDA context, its CUDA graphs' memory pool and untagged buffers.
ENGINE_ASLEEP_BYTES = 2 * GiB
# An engine sized by bytes (vLLM's kv_cache_memory_bytes, the native engine's kv_cache_tokens) holds its
# bf16 weights, its KV cache and this much more: a forward's activations, CUDA graphs, its CUDA context.
ENGINE_RUNTIME_BYTES = 3 * GiB
# vLLM's share when a native engine drafts with a vLLM instance sized by nothing else
# (rollout_service.vllm.instance.VLLMInstance: sized_options' gpu_share).
VLLM_PROPOSER_SHARE = 0.4


@dataclass(frozen=True)
class EngineMemory:
    """A colocated rollout engine's bytes on the shared GPU: while the rank trains, and awake."""
    while_training: int
    awake: int
    sizing: str  # how its share was sized, for messages
    while_training_as: str  # what it holds while the rank trains, for messages


def engine_memory(cfg: RecipeConfig, model: ModelShape, gpu_bytes: int | None) -> EngineMemory:
    """The rollout engine next to a colocated rank, from rollout.engine. vLLM: its share is
    gpu_memory_utilization x the GPU (vllm_options' first, else the engine's, else VLLMEngine's default), or
    with vllm_options.kv_cache_memory_bytes that KV cache + its bf16 weights + ENGINE_RUNTIME_BYTES; asleep it
    keeps ENGINE_ASLEEP_BYTES, and its weights where early_weights_wake maps them back while the rank trains.
    The native engine never sleeps: its weights + kv_cache_tokens of KV + ENGINE_RUNTIME_BYTES (+ its vLLM
    drafter's share with fast_path vllm). A second vLLM engine (stock_for_off) doubles what is sized per
    engine. Tensor parallelism spreads weights and KV over its GPUs."""
    engine = cfg.rollout.engine
    tp = engine.get("tensor_parallel_size", 1) or 1
    weights = BF16 * model.params // tp
    if worker_backend_of(cfg) == "native":
        return _native_engine_memory(engine, model, weights, tp, gpu_bytes)
    vllm_options = engine.get("vllm_options") or {}
    engines = 2 if engine.get("stock_for_off") and not engine.get("stock_only") and cfg.numerics != "stock" else 1
    kv_bytes = vllm_options.get("kv_cache_memory_bytes")
    if kv_bytes:
        awake = engines * (int(kv_bytes) + weights + ENGINE_RUNTIME_BYTES)
        label = f"vLLM, kv_cache_memory_bytes {int(kv_bytes) / GiB:.1f} GiB + weights"
    else:
        share = vllm_options.get("gpu_memory_utilization", engine.get("gpu_memory_utilization"))
        share = _vllm_default_share() if share is None else share
        # vLLM fills its share (its KV cache takes what the rest leaves); what it keeps asleep is counted on
        # top, as its sleep frees a little more than the share (docs/performance.md: 43.5 GiB at 0.3 of an H200)
        awake = (int(share * gpu_bytes) if gpu_bytes else 0) + engines * ENGINE_ASLEEP_BYTES
        label = f"vLLM, gpu_memory_utilization {share:g}"
    if not engine_sleeps(cfg):
        return EngineMemory(awake, awake, label, "awake: rollout.sleep_while_training is false")
    asleep = engines * (ENGINE_ASLEEP_BYTES + (weights if engine.get("early_weights_wake") else 0))
    early = ", its weights mapped back by early_weights_wake" if engine.get("early_weights_wake") else ""
    return EngineMemory(asleep, awake, label, f"asleep{early}")


def engine_sleeps(cfg: RecipeConfig) -> bool:
    """The rollout engines release their memory while the rank trains: recipes.rollouts.engines_sleep, on
    vLLM workers (the native engine has no sleep)."""
    return engines_sleep(cfg) and worker_backend_of(cfg) == "vllm"


def worker_backend_of(cfg: RecipeConfig) -> str:
    """The engine the run's rollout workers will run ("vllm" on GPUs where vLLM is installed, else
    "native"): the memory plan runs before the pool exists, so it asks the rule the workers follow
    (rollout_service.service.worker.engine_backend, imported where used: it imports Ray)."""
    from rollout_service.service.worker import engine_backend
    engine = cfg.rollout.engine
    device = engine.get("device") or ("cuda" if cfg.rollout.resources_per_worker.get("num_gpus", 0) else "cpu")
    return engine_backend(engine.get("backend", "auto"), device, engine.get("tensor_parallel_size", 1))


def _native_engine_memory(engine: dict, model: ModelShape, weights: int, tp: int, gpu_bytes: int | None):
    from rollout_service.engine.config import EngineConfig
    tokens = engine.get("kv_cache_tokens", EngineConfig.kv_cache_tokens)
    held = weights + tokens * model.kv_bytes_per_token // tp + ENGINE_RUNTIME_BYTES
    label = f"native engine, kv_cache_tokens {tokens}"
    if engine.get("fast_path") == "vllm":
        share = (engine.get("fast_path_options") or {}).get("gpu_memory_utilization", VLLM_PROPOSER_SHARE)
        held += int(share * gpu_bytes) if gpu_bytes else 0
        label += f" and a vLLM drafter at gpu_memory_utilization {share:g}"
    return EngineMemory(held, held, label, "awake: the native engine never sleeps")


def _vllm_default_share() -> float:
    """VLLMEngine's gpu_memory_utilization default (its signature is the one place it is set)."""
    from rollout_service.vllm.engine import VLLMEngine
    return inspect.signature(VLLMEngine).parameters["gpu_memory_utilization"].default
