"""RolloutWorker: a Ray actor that owns one engine and serves many requests at once (its request loop:
engine_server.EngineServer), takes weight pushes and sleeps while a colocated trainer needs the GPU.
"""
from __future__ import annotations

import asyncio
import copy
import importlib.util
import logging
import os

import ray
import torch

from rollout_service.engine.config import ParallelConfig, split_worker_options
from rollout_service.engine.engine import Engine
from rollout_service.engine.model_loading import load_model
from rollout_service.engine.tp import create_tp_group
from rollout_service.lora import LoraAdapter, push_digest
from rollout_service.service.engine_server import EngineServer
from rollout_service.service.ray_cluster import actor_gpu_ids
from rollout_service.service.switch_modes import SWITCH_IN_FLIGHT, check_switch_mode
from rollout_service.service.weight_sync.inbox import PushInbox
from rollout_service.service.weight_sync.plan import gpu_uuid
from rollout_service.weights import load_weights

log = logging.getLogger(__name__)


# Native-engine tuning (decode-verify-rollback, its own KV cache) that a vLLM worker has no use for
NATIVE_ONLY_KWARGS = frozenset({"fast_path", "fast_path_options", "window", "group", "kv_cache_tokens",
                                "block_size", "max_prefill_tokens", "verified_decode", "runner_factory"})


def _log_failure(what: str):
    """A done callback for work nobody awaits: its failure is logged, not left unread."""
    def check(task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s failed: %r", what, task.exception())
    return check


def engine_backend(backend: str, device: str, tensor_parallel_size: int = 1, gpus: int = 1) -> str:
    """The engine a worker runs (see ParallelConfig): "auto" resolved for this device and the number
    of GPUs the worker holds (vLLM's tensor parallelism runs all ranks inside the worker)."""
    parallel = ParallelConfig(tensor_parallel_size, backend)
    if parallel.backend != "auto":
        return parallel.backend
    on_gpu = str(device).startswith("cuda") and gpus >= tensor_parallel_size
    return "vllm" if on_gpu and importlib.util.find_spec("vllm") else "native"


def build_engine(model, engine_kwargs: dict | None):
    """(the worker's engine, its TP group or None, the full model kept on the host for a TP group's
    state_dict / model_copy, or None)."""
    parallel, kwargs = split_worker_options(engine_kwargs)
    kwargs.setdefault("copy_model", False)  # the model was deserialized for this actor alone
    if "device" not in kwargs and ray.get_gpu_ids():
        kwargs["device"] = "cuda"  # Ray has set CUDA_VISIBLE_DEVICES to this actor's GPUs
    tp = parallel.tensor_parallel_size
    # GPUs this actor may use: Ray's grant, or every visible one where Ray granted none
    gpus = len(ray.get_gpu_ids()) or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    backend = engine_backend(parallel.backend, kwargs.get("device", "cpu"), tp, gpus)
    if backend == "vllm":
        from rollout_service.vllm.engine import VLLMEngine  # vLLM is optional
        return VLLMEngine(model, tensor_parallel_size=tp,
                          **{k: v for k, v in kwargs.items() if k not in NATIVE_ONLY_KWARGS}), None, None
    if tp > 1:
        # a TP group of rank actors in its own placement group; rank 0 holds the engine
        group = create_tp_group(model, tp, kwargs, use_gpu=kwargs.get("device", "cpu") != "cpu")
        return group.engine(), group, load_model(model, "cpu", copy_model=False)
    return Engine(model, **kwargs), None, None


@ray.remote
class RolloutWorker(EngineServer):
    """One engine behind an async actor: its requests (EngineServer), its weights (whole state dicts
    here; bucketed pushes through weight_sync.inbox.PushInbox) and its sleep."""

    def __init__(self, model, engine_kwargs: dict | None = None):
        # An engine that cannot be built is reported by ready() as its own exception (type and
        # message), not as the actor's death, which reaches callers as Ray's ActorDiedError.
        self._init_error: Exception | None = None
        engine, self._tp_group, self._full_model = None, None, None
        try:
            engine, self._tp_group, self._full_model = build_engine(model, engine_kwargs)
        except Exception as e:
            self._init_error = e
        super().__init__(engine)
        self._pushes = PushInbox(self._engine, self._call, self._hold, self._release, self._wake_engine,
                                 self._set_version)  # bucketed pushes (weight_sync.inbox)

    # -- lifecycle -------------------------------------------------------------------------------

    async def ready(self) -> dict:
        if self._init_error is not None:
            raise self._init_error
        self._start()
        bucketed = self._engine.capabilities().bucketed_push  # TP groups take whole state dicts only
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "digest": await self._call(self._engine.weights_digest),
                "canonical": await self._call(self._engine.canonical_config),
                "spec": await self._call(self._engine.weight_spec) if bucketed else None, "gpu": self._gpu_uuid(),
                "gpu_ids": actor_gpu_ids(), "switch_modes": list(self._switch_modes),
                "capabilities": self._engine.capabilities()}

    def _gpu_uuid(self) -> str | None:
        """The GPU that bucketed pushes reach this worker's engine on (None: not on a GPU, or no such pushes)."""
        device = torch.device(self._engine.device if self._engine.capabilities().bucketed_push else "cpu")
        return gpu_uuid(device) if device.type == "cuda" else None

    async def liveness(self) -> None:
        """Never returns: the pool keeps one call outstanding, which fails the moment this actor dies."""
        await asyncio.get_running_loop().create_future()

    async def load(self) -> dict:
        return {"in_flight": len(self._futures), "completed": self._completed}

    # -- weights ---------------------------------------------------------------------------------

    async def update_weights(self, state_dict, expected_digest: str | None = None, version: int | None = None,
                             mode: str = "drain") -> str:
        """Load weights and stamp later tokens with `version` (default: the current one + 1). Drain and
        finish-then-switch: new requests wait and the ones in the engine finish first, so no rollout
        mixes two versions; switch-in-flight: between two engine steps (service/switch_modes.py).
        Weights that fail a check (or whose digest is not `expected_digest`) are refused before
        anything is loaded."""
        self._start()
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"version must be an int, got {version!r}")
        if check_switch_mode(mode) not in self._switch_modes:
            raise ValueError(f"this worker's engine ({type(self._engine).__name__}) cannot switch weights "
                             f"{mode!r}; it takes {self._switch_modes}")
        async with self._update_lock:
            drain = mode != SWITCH_IN_FLIGHT
            if drain:
                await self._drain()
            try:
                return await self._call(self._update_weights, state_dict, expected_digest, version)
            finally:
                if drain:
                    self._resume()

    # bucketed pushes, from the pool and the sender: weight_sync.inbox.PushInbox says what each step does
    async def begin_weight_receive(self, wire: bytes, rank: int, world_size: int) -> dict:
        self._start()
        return await self._pushes.begin(wire, rank, world_size)

    async def receive_weight_bucket(self, sync_id: str, index: int, handle, fingerprints: list | None = None,
                                    kept: bool = False) -> None:
        await self._pushes.bucket(sync_id, index, handle, fingerprints, kept)

    async def abandon_weight_receive(self, sync_id: str, reason: str) -> None:
        await self._pushes.abandon(sync_id, reason)

    async def end_weight_receive(self, sync_id: str, error: str | None = None) -> dict:
        return await self._pushes.end(sync_id, error)

    async def weights_digest(self) -> str:
        return await self._call(self._engine.weights_digest)

    # -- LoRA adapters (an engine with capabilities().lora_adapters: engine/protocol.py LoraEngine) -------

    async def load_adapter(self, name: str, adapter, expected_digest: str | None = None,
                           version: int | None = None) -> str:
        """Serve `adapter` (a rollout_service.lora.LoraAdapter, or a PEFT checkpoint directory this worker
        can read) as `name`, drained like a whole-weights push, later tokens stamped with `version`.
        Returns push_digest(the adapter's digest, the base's). A refused adapter (AdapterError: wrong
        base, rank, target module, values or `expected_digest`) changes nothing."""
        self._start()
        if not self._engine.capabilities().lora_adapters:
            raise ValueError(f"this worker's engine ({type(self._engine).__name__}) serves no LoRA adapters")
        async with self._update_lock:
            await self._drain()
            try:
                return await self._call(self._load_adapter, name, adapter, expected_digest, version)
            finally:
                self._resume()

    def _load_adapter(self, name: str, adapter, expected_digest: str | None, version: int | None) -> str:
        self._wake_engine()
        info = self._engine.load_adapter(name, adapter, expected_digest, version)
        self._set_version(version)
        return push_digest(info.digest, self._engine.weights_digest())

    async def adapter(self, name: str):
        """A host copy of adapter `name` as served (a restarted peer loads it from here)."""
        def snapshot():
            held = self._engine.adapter(name)
            return LoraAdapter.from_settings(held.settings(), {k: t.detach().to("cpu", copy=True)
                                                               for k, t in held.tensors.items()})
        return await self._call(snapshot)

    # -- sleep (colocated placement) ---------------------------------------------------------------
    # Rule: sleeping is the engine's memory released for another process on the GPU (a trainer
    # rank), never a state a caller must undo: the engine thread wakes the engine before any work
    # that needs it (a request, a weight load), so a forgotten wake() costs time, not an error.

    async def sleep(self) -> None:
        """Finish what the engine holds, then release its memory (vLLM's sleep mode: KV cache freed,
        weights offloaded to the host; nothing on CPU or in the native engine). Returns once it is
        released; the engine may then map its weights again behind it (VLLMEngine early_weights_wake)
        on the engine thread, where any later call runs after it."""
        self._start()
        async with self._update_lock:
            await self._drain()
            try:
                await self._call(self._sleep_engine)
            finally:
                self._resume()
        behind = asyncio.ensure_future(self._call(self._engine.wake_weights))
        behind.add_done_callback(_log_failure("the weights' wake behind a sleep (the next wake maps them)"))

    async def wake(self) -> None:
        self._start()
        await self._call(self._wake_engine)

    def _model(self):
        return self._engine.model if self._full_model is None else self._full_model

    def _update_weights(self, state_dict, expected_digest: str | None, version: int | None) -> str:
        self._wake_engine()
        digest = self._engine.update_weights(state_dict, expected_digest=expected_digest)
        if self._full_model is not None:
            load_weights(self._full_model, state_dict)
        self._set_version(version)
        return digest

    async def state_dict(self) -> dict:
        """A host copy of the current weights (how a restarted worker gets them from a ready peer
        after a push that went worker to worker, or whose sender's object is gone)."""
        def snapshot():
            return {k: v.detach().to("cpu", copy=True) for k, v in self._model().state_dict().items()}
        return await self._call(snapshot)

    async def model_copy(self):
        """The engine's model on CPU (the pool keeps it to restart workers after its sender exits)."""
        return await self._call(lambda: copy.deepcopy(self._model()).to("cpu"))
