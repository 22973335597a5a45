"""RolloutWorker: a Ray actor that owns one Engine and serves many requests at once.

Callers await `generate`; a background task feeds new requests to the engine and calls
`engine.step()` while any are unfinished, so concurrent requests share the engine's batches.
"""
from __future__ import annotations

import asyncio
import copy
import importlib.util
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import ray
import torch

from rollout_service.engine.config import ParallelConfig, split_worker_options
from rollout_service.engine.engine import Engine, load_model
from rollout_service.engine.tp import create_tp_group
from rollout_service.params import Rollout
from rollout_service.service.ray_cluster import actor_gpu_ids
from rollout_service.service.switch_modes import SWITCH_IN_FLIGHT, check_switch_mode, engine_switch_modes
from rollout_service.service.weight_sync import SyncPlan, WeightReceiver, gpu_uuid
from rollout_service.weights import load_weights

log = logging.getLogger(__name__)


def error_rollout(prompt, message: str) -> Rollout:
    prompt = list(prompt) if isinstance(prompt, (list, tuple)) else []
    return Rollout(prompt_token_ids=prompt, finish_reason="error", error=message)


def abort_rollout(prompt) -> Rollout:
    prompt = list(prompt) if isinstance(prompt, (list, tuple)) else []
    return Rollout(prompt_token_ids=prompt, finish_reason="abort")


class EarlyCancels:
    """Cancels that arrived before their request (Ray may deliver calls to an async actor out of
    order). They expire after `ttl` seconds, so a cancel that raced a finishing request does not
    hit a later request that reuses its id."""

    def __init__(self, ttl: float = 10.0):
        self.ttl = ttl
        self._keys: dict[str, float] = {}

    def add(self, key: str) -> None:
        now = time.monotonic()
        if len(self._keys) > 1024:
            self._keys = {k: t for k, t in self._keys.items() if t > now}
        self._keys[key] = now + self.ttl

    def pop(self, key: str) -> bool:
        deadline = self._keys.pop(key, None)
        return deadline is not None and deadline > time.monotonic()


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


@ray.remote
class RolloutWorker:
    """One engine behind an async actor.

    Every engine call runs on one dedicated thread (the engine is not thread-safe), which keeps the
    actor's event loop free to accept requests, aborts and weight updates while a step runs.
    """

    def __init__(self, model, engine_kwargs: dict | None = None):
        # An engine that cannot be built is reported by ready() as its own exception (type and
        # message), not as the actor's death, which reaches callers as Ray's ActorDiedError.
        self._init_error: Exception | None = None
        self._tp_group = self._full_model = None
        try:
            self._build_engine(model, engine_kwargs)
        except Exception as e:
            self._init_error = e
            self._engine = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._pending: list[tuple[str, list, object]] = []  # not yet handed to the engine
        self._futures: dict[str, asyncio.Future] = {}
        self._prompts: dict[str, list] = {}
        self._rid_of: dict[str, int] = {}  # key -> engine request id, while in the engine
        self._key_of: dict[int, str] = {}
        self._to_abort: list[int] = []
        self._aborted_rids: set[int] = set()
        self._early_aborts = EarlyCancels()
        self._updating = False
        self._ticking = False
        self._asleep = False  # engine memory released (sleep); touched only on the engine thread
        self._completed = 0
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self._loop_task: asyncio.Task | None = None
        self._receiver: WeightReceiver | None = None  # the bucketed push in progress
        # what end_weight_receive waits for: broadcast, the engine thread's receive_all; ipc, the push's last
        # bucket call, or its abandonment (abandon_weight_receive)
        self._receiving: asyncio.Future | None = None
        self._bucket_calls = 0  # ipc bucket calls of the push in progress not yet returned
        self._abandoned: str | None = None  # why the ipc push in progress was abandoned
        self._weight_groups: dict[str, tuple] = {}  # broadcast groups kept between pushes (weight_sync)
        self._ipc_buffers: dict = {}  # the sender's kept stage, opened by ipc, kept between pushes (weight_sync)
        # the version id of the weights the engine holds (the pool's count of adopted pushes; set and read
        # on the engine thread only), and each admitted request's version at admission (event loop)
        self._version = 0
        self._admitted_version: dict[str, int] = {}
        self._switch_modes = engine_switch_modes(self._engine) if self._engine is not None else ()

    def _build_engine(self, model, engine_kwargs: dict | None) -> None:
        parallel, kwargs = split_worker_options(engine_kwargs)
        kwargs.setdefault("copy_model", False)  # the model was deserialized for this actor alone
        if "device" not in kwargs and ray.get_gpu_ids():
            kwargs["device"] = "cuda"  # Ray has set CUDA_VISIBLE_DEVICES to this actor's GPUs
        tp = parallel.tensor_parallel_size
        # GPUs this actor may use: Ray's grant, or every visible one where Ray granted none
        gpus = len(ray.get_gpu_ids()) or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
        backend = engine_backend(parallel.backend, kwargs.get("device", "cpu"), tp, gpus)
        self._tp_group = None
        if backend == "vllm":
            from rollout_service.vllm.engine import VLLMEngine  # vLLM is optional
            self._engine = VLLMEngine(model, tensor_parallel_size=tp,
                                      **{k: v for k, v in kwargs.items() if k not in NATIVE_ONLY_KWARGS})
            self._full_model = None
        elif tp > 1:
            # a TP group of rank actors in its own placement group; rank 0 holds the engine
            self._tp_group = create_tp_group(model, tp, kwargs, use_gpu=kwargs.get("device", "cpu") != "cpu")
            self._engine = self._tp_group.engine()
            self._full_model = load_model(model, "cpu", copy_model=False)  # for state_dict / model_copy
        else:
            self._engine = Engine(model, **kwargs)
            self._full_model = None

    # -- lifecycle -------------------------------------------------------------------------------

    def _start(self):
        # asyncio objects must be made on the actor's event loop, which __init__ does not run on.
        if self._wake is None:
            self._wake, self._changed = asyncio.Event(), asyncio.Event()
            self._update_lock = asyncio.Lock()
        if self._loop_task is None or self._loop_task.done():  # (re)started by the next call
            self._loop_task = asyncio.get_running_loop().create_task(self._serve())

    async def ready(self) -> dict:
        if self._init_error is not None:
            raise self._init_error
        self._start()
        spec = getattr(self._engine, "weight_spec", None)  # None: no bucketed pushes (TP groups)
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "digest": await self._call(self._engine.weights_digest),
                "canonical": await self._call(self._engine.canonical_config),
                "spec": await self._call(spec) if spec is not None else None, "gpu": self._gpu_uuid(),
                "gpu_ids": actor_gpu_ids(), "switch_modes": list(self._switch_modes)}

    def _gpu_uuid(self) -> str | None:
        device = torch.device(getattr(self._engine, "device", "cpu"))
        return gpu_uuid(device) if device.type == "cuda" else None

    async def liveness(self) -> None:
        """Never returns: the pool keeps one call outstanding, which fails the moment this actor dies."""
        await asyncio.get_running_loop().create_future()

    async def load(self) -> dict:
        return {"in_flight": len(self._futures), "completed": self._completed}

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- requests --------------------------------------------------------------------------------

    async def generate(self, key: str, prompt, params) -> Rollout:
        self._start()
        if self._early_aborts.pop(key):
            return abort_rollout(prompt)
        if key in self._futures:
            return error_rollout(prompt, f"duplicate request id {key!r} on this worker")
        fut = asyncio.get_running_loop().create_future()
        self._futures[key], self._prompts[key] = fut, prompt
        self._pending.append((key, prompt, params))
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:  # the caller cancelled this call (ray.cancel)
            self._abort(key)
            raise

    async def abort(self, key: str) -> None:
        self._start()
        self._abort(key)

    def _abort(self, key: str) -> None:
        if key in self._rid_of:
            self._to_abort.append(self._rid_of[key])
            self._wake.set()
        elif key in self._futures:  # still pending: never reached the engine
            self._pending = [p for p in self._pending if p[0] != key]
            self._resolve(key, abort_rollout(self._prompts[key]))
        else:
            self._early_aborts.add(key)

    def _resolve(self, key: str, rollout: Rollout) -> None:
        version = self._admitted_version.pop(key, None)
        if version is not None and SWITCH_IN_FLIGHT not in self._switch_modes:
            # weights change only with nothing in this engine: the whole request ran on one version
            rollout.weight_versions = [version] * len(rollout.token_ids)
        fut = self._futures.pop(key, None)
        self._prompts.pop(key, None)
        rid = self._rid_of.pop(key, None)
        if rid is not None:
            self._key_of.pop(rid, None)
            self._aborted_rids.discard(rid)
        if fut is not None and not fut.done():
            self._completed += 1
            fut.set_result(rollout)

    async def _serve(self):
        while True:
            admit = [] if self._updating else self._pending
            if not (admit or self._to_abort or self._rid_of):
                self._changed.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._updating:
                self._pending = []
            aborts, self._to_abort = self._to_abort, []
            self._ticking = True
            try:
                added, finished, idle = await self._call(self._tick, admit, aborts)
            except Exception as e:  # the engine failed: fail what it held rather than hang
                rids = list(self._rid_of.values())
                for key in list(self._rid_of):
                    self._resolve(key, error_rollout(self._prompts.get(key), f"engine failure: {e!r}"))
                for key, prompt, _ in admit:
                    self._resolve(key, error_rollout(prompt, f"engine failure: {e!r}"))
                try:  # and free what the engine still holds for them
                    await self._call(self._abort_all, rids)
                except Exception:
                    pass
                continue
            finally:
                self._ticking = False
            for key, rid, version in added:
                self._admitted_version[key] = version
                if isinstance(rid, Exception):
                    self._resolve(key, error_rollout(self._prompts.get(key), f"{type(rid).__name__}: {rid}"))
                    continue
                self._rid_of[key], self._key_of[rid] = rid, key
                if key not in self._futures:  # its caller went away while it was being added
                    self._to_abort.append(rid)
            self._aborted_rids.update(aborts)
            for rid, rollout in finished:
                key = self._key_of.get(rid)
                if key is not None:
                    self._resolve(key, rollout)
            if idle:  # the engine holds nothing, so anything still tracked will never finish
                for key in list(self._rid_of):
                    rid = self._rid_of[key]
                    self._resolve(key, abort_rollout(self._prompts.get(key)) if rid in self._aborted_rids
                                  else error_rollout(self._prompts.get(key), "the engine dropped the request"))
            self._changed.set()

    def _abort_all(self, rids):
        for rid in rids:
            self._engine.abort(rid)

    def _tick(self, admit, aborts):
        """One engine round on the engine thread: admit, abort, step."""
        self._wake_engine()
        added = []
        for key, prompt, params in admit:
            try:
                added.append((key, self._engine.add_request(prompt, params), self._version))
            except Exception as e:  # InvalidRequestError and anything else this request cannot pass
                added.append((key, e, None))
        for rid in aborts:
            self._engine.abort(rid)
        finished = self._engine.step() if self._engine.has_unfinished() else []
        return added, finished, not self._engine.has_unfinished()

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

    async def _drain(self) -> None:
        """Stop admitting requests and wait until the engine holds none."""
        self._updating = True
        while self._rid_of or self._ticking:
            self._changed.clear()
            await self._changed.wait()

    def _resume(self) -> None:
        self._updating = False
        self._wake.set()

    # bucketed pushes (weight_sync): begin, then buckets (ipc) or one background receive (broadcast), then end
    async def begin_weight_receive(self, wire: bytes, rank: int, world_size: int) -> dict:
        """Drain, then wait for the sender's buckets (the plan: SyncPlan's wire form); the engine serves
        nothing until end_weight_receive. Returns {"seconds": this call's own time}."""
        plan = SyncPlan.from_wire(wire)
        start = time.perf_counter()
        self._start()
        await self._update_lock.acquire()
        try:
            # Rule: the engine is woken by the push's first load (on the engine thread), or before it by the
            # sender's wake once the rank's backward is over (WeightSender.wake_workers), not here: an armed
            # begin comes while a colocated rank trains, which the sleeping engine's memory is for
            await self._drain()
            device = getattr(self._engine, "device", torch.device("cpu"))
            if not hasattr(self._engine, "load_named_weights"):
                raise ValueError("this worker's engine takes no bucketed pushes")
            if plan.new_group:  # a worker serves one pool: a new group replaces any it held
                self._weight_groups.clear()
            self._receiver = WeightReceiver(plan, device, self._engine.load_named_weights, rank, world_size,
                                            self._weight_groups, getattr(self._engine, "wait_host_copies", None),
                                            self._ipc_buffers, wake=self._wake_engine)
            loop = asyncio.get_running_loop()
            self._receiving = loop.run_in_executor(self._thread, self._receiver.receive_all) \
                if plan.transport == "broadcast" else loop.create_future()
            self._bucket_calls, self._abandoned = 0, None
            return {"seconds": time.perf_counter() - start}
        except BaseException:
            self._receiver = self._receiving = None
            self._resume()
            self._update_lock.release()
            raise

    async def receive_weight_bucket(self, sync_id: str, index: int, handle, fingerprints: list | None = None,
                                    kept: bool = False) -> None:
        """ipc: bucket `index` of the push, read from the sender's buffer (WeightReceiver.receive_ipc);
        the first carries the fingerprints, the sender's go. The last bucket, taken, lets the pending
        end_weight_receive adopt the push; after a bucket that failed, the end waits for the pool's
        abandon_weight_receive (the sender aborts on the failure it gets back)."""
        receiver = self._current_receiver(sync_id)
        if self._abandoned is not None:
            raise RuntimeError(f"the push was abandoned: {self._abandoned}")
        start = time.perf_counter()
        self._bucket_calls += 1
        taken = False
        try:
            await self._call(receiver.receive_ipc, index, handle, fingerprints, kept)
            taken = True
        finally:
            self._bucket_calls -= 1
            receiver.seconds["call"] = receiver.seconds.get("call", 0.0) + time.perf_counter() - start
            if (taken and index == len(receiver.plan.buckets) - 1) or \
                    (self._abandoned is not None and self._bucket_calls == 0):
                self._received_all()

    async def abandon_weight_receive(self, sync_id: str, reason: str) -> None:
        """ipc: the pool's word that no more buckets will come (the sender gave up or declined, or the push
        timed out). The pending end_weight_receive then answers as for an abandoned push, once any bucket
        call still on the engine thread has returned. A no-op once this worker's end has answered."""
        if self._receiver is None or self._receiver.plan.sync_id != sync_id or self._abandoned is not None:
            return
        self._abandoned = reason
        if self._bucket_calls == 0:
            self._received_all()

    def _received_all(self) -> None:
        if self._receiving is not None and not self._receiving.done():
            self._receiving.set_result(None)

    async def end_weight_receive(self, sync_id: str, error: str | None = None) -> dict:
        """{"digest": the digest now held, after checking that everything arrived, "seconds": where this
        worker's share of the push went}; digest None if nothing was loaded, with `error` (the sender gave
        up; by ipc also abandon_weight_receive's reason) or after a header's no-go. Raises if the engine
        holds part of the push (the pool restarts it). Asked by the pool right after begin: it answers once
        the receive has ended (broadcast) or the last bucket has come (ipc)."""
        receiver = self._current_receiver(sync_id)
        if receiver.plan.transport == "ipc" and error is not None:  # no end was asked at begin (it failed)
            await self.abandon_weight_receive(sync_id, error)
        if error is not None and receiver.plan.transport == "broadcast" and not self._receiving.done():
            # the engine thread waits in a broadcast the sender will not finish: not this actor's to mend
            raise RuntimeError(f"the push was abandoned while this worker was receiving it: {error}")
        try:
            try:
                if self._receiving is not None:
                    await self._receiving
                error = error if error is not None else self._abandoned
                if error is None and not receiver.declined:
                    return await self._call(self._adopt, receiver)
            except Exception as e:
                if receiver.loaded_any:  # the engine holds part of the push: only a restart mends that
                    raise RuntimeError(f"this worker loaded part of the push, then: {e!r}") from e
                raise
            if receiver.loaded_any:
                raise RuntimeError(f"the push was abandoned after part of it was loaded: {error}")
            return {"digest": None, "seconds": receiver.seconds}
        finally:
            self._receiver = self._receiving = self._abandoned = None
            self._resume()
            self._update_lock.release()

    def _adopt(self, receiver: WeightReceiver) -> dict:
        """On the engine thread, in one call: the push checked complete, the engine's load finished and
        the version taken (end_weight_receive's result)."""
        digest = receiver.finish()
        start = time.perf_counter()
        self._engine.finish_weight_load()
        self._set_version(receiver.plan.version)
        return {"digest": digest, "seconds": {**receiver.seconds, "engine": time.perf_counter() - start}}

    def _current_receiver(self, sync_id: str) -> WeightReceiver:
        if self._receiver is None or self._receiver.plan.sync_id != sync_id:
            raise RuntimeError(f"no weight push {sync_id!r} in progress on this worker")
        return self._receiver

    async def weights_digest(self) -> str:
        return await self._call(self._engine.weights_digest)

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

    def _sleep_engine(self) -> None:
        if not self._asleep:
            self._engine.sleep()
            self._asleep = True

    def _wake_engine(self) -> None:
        if self._asleep:
            self._engine.wake()
            self._asleep = False

    def _model(self):
        return self._engine.model if self._full_model is None else self._full_model

    def _update_weights(self, state_dict, expected_digest: str | None, version: int | None) -> str:
        self._wake_engine()
        digest = self._engine.update_weights(state_dict, expected_digest=expected_digest)
        if self._full_model is not None:
            load_weights(self._full_model, state_dict)
        self._set_version(version)
        return digest

    def _set_version(self, version: int | None) -> None:
        """On the engine thread, right after a load: later admissions (and, in an engine that stamps
        tokens itself, later tokens) carry `version`."""
        self._version = self._version + 1 if version is None else version
        if SWITCH_IN_FLIGHT in self._switch_modes:
            self._engine.weight_version = self._version

    async def state_dict(self) -> dict:
        """A host copy of the current weights (how a restarted worker gets them from a ready peer
        after a push that went worker to worker, or whose sender's object is gone)."""
        def snapshot():
            return {k: v.detach().to("cpu", copy=True) for k, v in self._model().state_dict().items()}
        return await self._call(snapshot)

    async def model_copy(self):
        """The engine's model on CPU (the pool keeps it to restart workers after its sender exits)."""
        return await self._call(lambda: copy.deepcopy(self._model()).to("cpu"))
