"""RolloutPool: a named Ray actor that routes requests over RolloutWorker actors.

Outputs are a pure function of (weights, prompt, params, seed), so the pool may send a request to
any worker, and re-run it elsewhere when its worker dies, without changing a single bit.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import ray
import torch
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

import kernels as K

from .client import DEFAULT_NAMESPACE, RolloutClient, ensure_ray
from .ray_cluster import on_bundle, release, reserve
from .weights import WeightMismatchError
from .worker import EarlyCancels, RolloutWorker, abort_rollout, error_rollout

# Concurrent calls an async actor accepts; requests beyond the engine's batch wait inside it.
MAX_CONCURRENCY = 100_000


@dataclass
class _Slot:
    index: int
    actor: object = None
    state: str = "starting"  # starting | ready | restarting | failed | stopped
    placement: object = None
    in_flight: int = 0
    completed: int = 0
    restarts: int = 0
    error: str | None = None
    info: dict = field(default_factory=dict)


class _PoolActor:
    """The pool's state and routing; lives in a named actor so that any driver can find it."""

    def __init__(self, num_workers: int, engine_kwargs: dict | None, resources_per_worker: dict | None,
                 placement_group_bundles: list[dict] | None, placement_strategy: str, max_retries: int):
        self._engine_kwargs = dict(engine_kwargs or {})
        if resources_per_worker is None and placement_group_bundles:
            # by default the worker takes exactly its bundle (bundle 0) of the group
            first = placement_group_bundles[0]
            resources_per_worker = {"num_cpus": first.get("CPU", 0), "num_gpus": first.get("GPU", 0)}
        self._resources = {"num_cpus": 1, **(resources_per_worker or {})}
        self._bundles = placement_group_bundles
        self._strategy = placement_strategy
        self._max_retries = max_retries
        self._slots = [_Slot(i) for i in range(num_workers)]
        self._model = None  # model path, or an ObjectRef of the model
        self._weights_ref = None  # last weights pushed, kept so that restarted workers load them too
        self._digest = None
        self._canonical = None  # kernels.CanonicalConfig of every worker
        self._version = 0
        self._in_flight = 0
        self._active: dict[str, _Slot | None] = {}
        self._cancelled: set[str] = set()
        self._early_cancels = EarlyCancels()
        self._counts = {"submitted": 0, "completed": 0, "errors": 0, "aborted": 0, "retried": 0}
        self._closed = False
        self._cond: asyncio.Condition | None = None
        self._gate: asyncio.Event | None = None  # cleared while weights are being swapped
        self._update_lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- workers ---------------------------------------------------------------------------------

    async def start(self, model_box: list, detached: bool) -> dict:
        """model_box: [a local path, or an ObjectRef of the model] (boxed: this actor never loads it)."""
        self._cond, self._gate, self._update_lock = asyncio.Condition(), asyncio.Event(), asyncio.Lock()
        self._gate.set()
        self._model = model_box[0]
        spawned = [await self._spawn(s) for s in self._slots]
        infos = await asyncio.gather(*(a.ready.remote() for a in spawned), return_exceptions=True)
        for slot, info in zip(self._slots, infos):
            if isinstance(info, Exception):
                await self.shutdown()
                raise RuntimeError(f"rollout worker {slot.index} failed to start: {info}") from info
            slot.info = info
        digests = {info["digest"] for info in infos}
        if len(digests) != 1:
            await self.shutdown()
            raise WeightMismatchError(f"workers loaded the same model with different digests: {digests}")
        self._digest = digests.pop()
        try:
            self._canonical = K.check_canonical({f"worker {s.index}": s.info["canonical"] for s in self._slots})
        except K.CanonicalMismatchError:
            await self.shutdown()
            raise
        if detached and isinstance(self._model, ray.ObjectRef):
            # The creating driver owns the model object and may exit before this pool does; a copy
            # returned by a worker is owned by this actor, so restarts can always read it.
            self._model = self._slots[0].actor.model_copy.remote()
        for slot in self._slots:
            await self._set_state(slot, "ready")
            self._watch(slot)
        return {"digest": self._digest, "canonical": self._canonical, "workers": [s.info for s in self._slots]}

    async def _spawn(self, slot: _Slot):
        if self._closed:
            raise RuntimeError("the rollout pool is shut down")
        opts = dict(self._resources, max_concurrency=MAX_CONCURRENCY)
        if self._bundles:
            if slot.placement is None:  # kept across restarts: the replacement reuses its reservation
                slot.placement = reserve(self._bundles, self._strategy)
            await slot.placement.ready()
            opts["scheduling_strategy"] = on_bundle(slot.placement, 0, capture_child_tasks=True)
        slot.actor = RolloutWorker.options(**opts).remote(self._model, self._engine_kwargs)
        return slot.actor

    def _watch(self, slot: _Slot):
        """Keep one call outstanding on the worker; it fails the moment the actor dies."""
        actor = slot.actor

        async def watch():
            try:
                await actor.liveness.remote()
            except RayActorError:
                self._on_dead(slot, actor)
        self._spawn_task(watch())

    def _spawn_task(self, coro):
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _set_state(self, slot: _Slot, state: str, error: str | None = None):
        async with self._cond:
            slot.state, slot.error = state, error
            self._cond.notify_all()

    def _on_dead(self, slot: _Slot, actor):
        if self._closed or slot.actor is not actor or slot.state != "ready":
            return  # already known, or an older incarnation
        slot.state = "restarting"
        self._spawn_task(self._restart(slot))

    async def _restart(self, slot: _Slot, reason: str = "died"):
        last = None
        for attempt in range(3):
            if self._closed:
                return
            try:
                ray.kill(slot.actor)
            except Exception:
                pass
            try:
                actor = await self._spawn(slot)
                slot.info = await actor.ready.remote()
                K.check_canonical({"the pool": self._canonical, f"restarted worker {slot.index}": slot.info["canonical"]})
                while True:  # load the current weights; again if they change meanwhile
                    version, expected = self._version, self._digest
                    digest = await self._load_current(actor, slot)
                    if version == self._version:
                        break
                if digest != expected:
                    raise WeightMismatchError(f"restarted worker {slot.index} has digest {digest}, expected {expected}")
                if self._closed:
                    ray.kill(actor)
                    return
                slot.restarts += 1
                await self._set_state(slot, "ready")
                self._watch(slot)
                return
            except Exception as e:
                last = e
                await asyncio.sleep(0.5 * (attempt + 1))
        await self._set_state(slot, "failed", f"{reason}; restart failed: {last!r}")

    async def _load_current(self, actor, slot: _Slot) -> str:
        if self._weights_ref is None:
            return await actor.weights_digest.remote()
        try:
            return await actor.update_weights.remote(self._weights_ref)
        except (ObjectLostError, RayTaskError) as e:
            if not isinstance(getattr(e, "cause", e), ObjectLostError):
                raise
        # The driver that sent the weights (their owner) is gone: copy them from a live worker, into
        # an object this actor owns.
        peers = [s for s in self._slots if s.state == "ready" and s is not slot]
        if not peers:
            raise RuntimeError("the current weights are lost (their sender exited) and no worker holds them")
        self._weights_ref = peers[0].actor.state_dict.remote()
        return await actor.update_weights.remote(self._weights_ref)

    async def _pick(self) -> _Slot | None:
        """The ready worker with the fewest requests in flight; waits while none is ready."""
        async with self._cond:
            while True:
                if self._closed:
                    return None
                ready = [s for s in self._slots if s.state == "ready"]
                if ready:
                    return min(ready, key=lambda s: (s.in_flight, s.completed))
                if all(s.state == "failed" for s in self._slots):
                    return None
                await self._cond.wait()

    # -- requests --------------------------------------------------------------------------------

    async def generate(self, requests: list[tuple[str, list, object]]) -> list:
        return list(await asyncio.gather(*(self._run(*r) for r in requests)))

    async def _run(self, key: str, prompt, params):
        if key in self._active:
            return self._count(error_rollout(prompt, f"duplicate request id {key!r}"))
        self._counts["submitted"] += 1
        self._active[key] = None
        if self._early_cancels.pop(key):
            self._cancelled.add(key)
        try:
            failures = []
            while len(failures) <= self._max_retries:
                while True:  # never dispatch while weights are being swapped
                    await self._gate.wait()
                    if key in self._cancelled:
                        return self._count(abort_rollout(prompt))
                    slot = await self._pick()
                    if slot is None:
                        return self._count(error_rollout(prompt, self._unavailable()))
                    if self._gate.is_set():
                        break
                actor = slot.actor
                slot.in_flight += 1
                self._in_flight += 1
                self._active[key] = slot
                try:
                    rollout = await actor.generate.remote(key, prompt, params)
                    slot.completed += 1
                    return self._count(rollout)
                except RayActorError as e:  # the worker died: run the request again elsewhere
                    failures.append(f"worker {slot.index}: {type(e).__name__}")
                    self._counts["retried"] += 1
                    self._on_dead(slot, actor)
                except RayTaskError as e:
                    return self._count(error_rollout(prompt, f"worker {slot.index} failed: {e.cause!r}"))
                except asyncio.CancelledError:  # this pool call was cancelled: stop the work too
                    actor.abort.remote(key)
                    raise
                finally:
                    slot.in_flight -= 1
                    self._in_flight -= 1
                    self._active[key] = None
                    if self._in_flight == 0:
                        async with self._cond:
                            self._cond.notify_all()
            return self._count(error_rollout(prompt, f"request failed on {len(failures)} workers: {failures}"))
        finally:
            del self._active[key]
            self._cancelled.discard(key)

    def _count(self, rollout):
        reason = rollout.finish_reason
        self._counts["errors" if reason == "error" else "aborted" if reason == "abort" else "completed"] += 1
        return rollout

    def _unavailable(self) -> str:
        if self._closed:
            return "the rollout pool is shut down"
        return "no healthy rollout workers: " + "; ".join(
            f"worker {s.index}: {s.error}" for s in self._slots if s.error)

    async def cancel(self, keys: list[str]) -> int:
        """Cancel requests by id; each finishes with finish_reason "abort". Returns how many were live."""
        found = 0
        for key in keys:
            if key not in self._active:  # not arrived yet (calls may overtake), or already done
                self._early_cancels.add(key)
                continue
            found += 1
            self._cancelled.add(key)
            slot = self._active[key]
            if slot is not None:
                slot.actor.abort.remote(key)
        return found

    # -- weights ---------------------------------------------------------------------------------

    async def update_weights(self, weights_box: list, expected: str) -> str:
        """Swap every worker to the weights in `weights_box[0]` (one ObjectRef, fetched by each worker
        from the object store) between requests, and check that each reports `expected`."""
        ref = weights_box[0]
        async with self._update_lock:
            self._gate.clear()
            try:
                async with self._cond:
                    await self._cond.wait_for(lambda: self._in_flight == 0)
                slots = [s for s in self._slots if s.state == "ready"]
                if not slots and all(s.state == "failed" for s in self._slots):
                    raise RuntimeError(self._unavailable())
                results = await asyncio.gather(*(s.actor.update_weights.remote(ref) for s in slots),
                                               return_exceptions=True)
                causes = [r.cause if isinstance(r, RayTaskError) else r for r in results]
                if slots and all(type(c).__name__ == "WeightMismatchError" for c in causes):
                    raise causes[0]  # every worker rejected them before loading: nothing changed
                self._weights_ref, self._digest = ref, expected
                self._version += 1
                bad = []
                for slot, result in zip(slots, causes):
                    if isinstance(result, RayActorError):
                        self._on_dead(slot, slot.actor)  # its restart loads the new weights
                    elif isinstance(result, Exception) or result != expected:
                        what = f"error {result!r}" if isinstance(result, Exception) else f"digest {result}"
                        bad.append(f"worker {slot.index}: {what}")
                        slot.state = "restarting"  # out of rotation until it verifiably holds them
                        self._spawn_task(self._restart(slot, reason=f"weight sync failed ({what})"))
                if bad:
                    raise WeightMismatchError(f"workers did not load the expected weights {expected}: {bad}")
                return expected
            finally:
                self._gate.set()

    async def weights_digest(self) -> str:
        return self._digest

    # -- status and shutdown ---------------------------------------------------------------------

    async def stats(self) -> dict:
        return {**self._counts, "in_flight": self._in_flight, "digest": self._digest,
                "workers": [{"index": s.index, "state": s.state, "in_flight": s.in_flight,
                             "completed": s.completed, "restarts": s.restarts, "error": s.error,
                             "pid": s.info.get("pid")} for s in self._slots]}

    async def worker_handles(self) -> list:
        return [s.actor for s in self._slots]

    async def shutdown(self) -> None:
        self._closed = True
        for slot in self._slots:
            if slot.actor is not None:
                try:
                    ray.kill(slot.actor)
                except Exception:
                    pass
            if slot.placement is not None:
                release(slot.placement)
                slot.placement = None
            slot.state = "stopped"
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()
        if self._gate is not None:
            self._gate.set()


_PoolActorRemote = ray.remote(_PoolActor)


class RolloutPool(RolloutClient):
    """Start `num_workers` RolloutWorker actors behind a pool actor named `name`.

    The pool is also a client of itself; other drivers and jobs reach it with RolloutClient(name).
    Workers are 1-CPU actors unless resources_per_worker (Ray actor options) says otherwise, e.g.
    {"num_gpus": 1}; a GPU worker's engine runs on "cuda" unless engine_kwargs names a device.
    placement_group_bundles (e.g. [{"GPU": 1, "CPU": 1}] * tp) gives each worker its own placement
    group (placement_strategy, STRICT_PACK: one node): the worker takes bundle 0, and actors it
    starts (tensor-parallel ranks) are captured in the group. A detached pool outlives its creating
    driver; shut it down with RolloutClient(name).shutdown().
    """

    def __init__(self, model, num_workers: int = 2, name: str = "rollout", engine_kwargs: dict | None = None,
                 resources_per_worker: dict | None = None, placement_group_bundles: list[dict] | None = None,
                 placement_strategy: str = "STRICT_PACK", namespace: str = DEFAULT_NAMESPACE,
                 detached: bool = False, max_retries: int = 3):
        # checked here, at the call: inside the actor a bad value would surface as ActorDiedError
        if isinstance(num_workers, bool) or not isinstance(num_workers, int):
            raise TypeError(f"num_workers must be an int, got {type(num_workers).__name__}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not isinstance(model, (str, os.PathLike, torch.nn.Module)):
            raise TypeError(f"model must be a Hugging Face model, a local checkpoint path or 'tiny:<arch>', "
                            f"got {type(model).__name__}")
        ensure_ray()
        options = dict(name=name, namespace=namespace, num_cpus=0, max_concurrency=MAX_CONCURRENCY)
        if detached:
            options["lifetime"] = "detached"  # outlives this driver; shut it down explicitly
        try:
            actor = _PoolActorRemote.options(**options).remote(
                num_workers, engine_kwargs, resources_per_worker, placement_group_bundles,
                placement_strategy, max_retries)
        except ValueError as e:
            raise ValueError(f"cannot create rollout pool {name!r} in namespace {namespace!r}: {e}") from e
        try:
            ray.get(actor.__ray_ready__.remote())
            model_box = [model if isinstance(model, (str, os.PathLike)) else ray.put(model)]
            self.info = ray.get(actor.start.remote(model_box, detached))
        except BaseException:
            ray.kill(actor)
            raise
        super().__init__(name, namespace=namespace, _handle=actor)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
