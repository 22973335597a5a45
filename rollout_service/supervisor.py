"""Supervision of a pool's RolloutWorker actors: start them (each in its own placement group when
asked), watch each for death, restart a dead or out-of-sync worker with the pool's current weights,
and shut them down. The pool actor (pool.py) routes requests over the workers kept "ready" here.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

import kernels as K

from .ray_cluster import on_bundle, release, reserve
from .weights import WeightMismatchError
from .worker import RolloutWorker

# Concurrent calls an async actor accepts; requests beyond the engine's batch wait inside it.
MAX_CONCURRENCY = 100_000


@dataclass
class WorkerSlot:
    index: int
    actor: object = None
    state: str = "starting"  # starting | ready | restarting | failed | stopped
    placement: object = None
    in_flight: int = 0
    completed: int = 0
    restarts: int = 0
    error: str | None = None
    info: dict = field(default_factory=dict)


class WorkerSupervisor:
    """The workers of one pool and the weights every one of them must hold (`digest`)."""

    def __init__(self, num_workers: int, engine_kwargs: dict | None, resources_per_worker: dict | None,
                 placement_group_bundles: list[dict] | None, placement_strategy: str):
        self._engine_kwargs = dict(engine_kwargs or {})
        if resources_per_worker is None and placement_group_bundles:
            # by default the worker takes exactly its bundle (bundle 0) of the group
            first = placement_group_bundles[0]
            resources_per_worker = {"num_cpus": first.get("CPU", 0), "num_gpus": first.get("GPU", 0)}
        self._resources = {"num_cpus": 1, **(resources_per_worker or {})}
        self._bundles = placement_group_bundles
        self._strategy = placement_strategy
        self.slots = [WorkerSlot(i) for i in range(num_workers)]
        self._model = None  # model path, or an ObjectRef of the model
        self._weights_ref = None  # last weights pushed, kept so that restarted workers load them too
        self.digest = None
        self.canonical = None  # kernels.CanonicalConfig of every worker
        self._version = 0
        self.closed = False
        # notified on every worker state change (and by the pool when its in-flight count drops)
        self.cond: asyncio.Condition | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, model_box: list, detached: bool) -> dict:
        """model_box: [a local path, or an ObjectRef of the model] (boxed: this actor never loads it)."""
        self.cond = asyncio.Condition()
        self._model = model_box[0]
        spawned = [await self._spawn(s) for s in self.slots]
        infos = await asyncio.gather(*(a.ready.remote() for a in spawned), return_exceptions=True)
        for slot, info in zip(self.slots, infos):
            if isinstance(info, Exception):
                await self.shutdown()
                raise RuntimeError(f"rollout worker {slot.index} failed to start: {info}") from info
            slot.info = info
        digests = {info["digest"] for info in infos}
        if len(digests) != 1:
            await self.shutdown()
            raise WeightMismatchError(f"workers loaded the same model with different digests: {digests}")
        self.digest = digests.pop()
        try:
            self.canonical = K.check_canonical({f"worker {s.index}": s.info["canonical"] for s in self.slots})
        except K.CanonicalMismatchError:
            await self.shutdown()
            raise
        if detached and isinstance(self._model, ray.ObjectRef):
            # The creating driver owns the model object and may exit before this pool does; a copy
            # returned by a worker is owned by this actor, so restarts can always read it.
            self._model = self.slots[0].actor.model_copy.remote()
        for slot in self.slots:
            await self._set_state(slot, "ready")
            self._watch(slot)
        return {"digest": self.digest, "canonical": self.canonical, "workers": [s.info for s in self.slots]}

    # -- which workers can take work ---------------------------------------------------------------

    def ready(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.state == "ready"]

    def all_failed(self) -> bool:
        return all(s.state == "failed" for s in self.slots)

    def unavailable(self) -> str:
        if self.closed:
            return "the rollout pool is shut down"
        return "no healthy rollout workers: " + "; ".join(
            f"worker {s.index}: {s.error}" for s in self.slots if s.error)

    # -- deaths and restarts -----------------------------------------------------------------------

    def on_dead(self, slot: WorkerSlot, actor):
        if self.closed or slot.actor is not actor or slot.state != "ready":
            return  # already known, or an older incarnation
        self.restart_later(slot, "died")

    def restart_later(self, slot: WorkerSlot, reason: str):
        """Out of rotation now; back when a replacement verifiably holds the current weights."""
        slot.state = "restarting"
        self._spawn_task(self._restart(slot, reason))

    def adopt_weights(self, weights_ref, digest: str) -> None:
        """The weights every worker must hold from now on (restarts load them)."""
        self._weights_ref, self.digest = weights_ref, digest
        self._version += 1

    async def _spawn(self, slot: WorkerSlot):
        if self.closed:
            raise RuntimeError("the rollout pool is shut down")
        opts = dict(self._resources, max_concurrency=MAX_CONCURRENCY)
        if self._bundles:
            if slot.placement is None:  # kept across restarts: the replacement reuses its reservation
                slot.placement = reserve(self._bundles, self._strategy)
            await slot.placement.ready()
            opts["scheduling_strategy"] = on_bundle(slot.placement, 0, capture_child_tasks=True)
        slot.actor = RolloutWorker.options(**opts).remote(self._model, self._engine_kwargs)
        return slot.actor

    def _watch(self, slot: WorkerSlot):
        """Keep one call outstanding on the worker; it fails the moment the actor dies."""
        actor = slot.actor

        async def watch():
            try:
                await actor.liveness.remote()
            except RayActorError:
                self.on_dead(slot, actor)
        self._spawn_task(watch())

    def _spawn_task(self, coro):
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _set_state(self, slot: WorkerSlot, state: str, error: str | None = None):
        async with self.cond:
            slot.state, slot.error = state, error
            self.cond.notify_all()

    async def _restart(self, slot: WorkerSlot, reason: str):
        last = None
        for attempt in range(3):
            if self.closed:
                return
            try:
                ray.kill(slot.actor)
            except Exception:
                pass
            try:
                actor = await self._spawn(slot)
                slot.info = await actor.ready.remote()
                K.check_canonical({"the pool": self.canonical, f"restarted worker {slot.index}": slot.info["canonical"]})
                while True:  # load the current weights; again if they change meanwhile
                    version, expected = self._version, self.digest
                    digest = await self._load_current(actor, slot)
                    if version == self._version:
                        break
                if digest != expected:
                    raise WeightMismatchError(f"restarted worker {slot.index} has digest {digest}, expected {expected}")
                if self.closed:
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

    async def _load_current(self, actor, slot: WorkerSlot) -> str:
        if self._weights_ref is None:
            return await actor.weights_digest.remote()
        try:
            return await actor.update_weights.remote(self._weights_ref)
        except (ObjectLostError, RayTaskError) as e:
            if not isinstance(getattr(e, "cause", e), ObjectLostError):
                raise
        # The driver that sent the weights (their owner) is gone: copy them from a live worker, into
        # an object this actor owns.
        peers = [s for s in self.slots if s.state == "ready" and s is not slot]
        if not peers:
            raise RuntimeError("the current weights are lost (their sender exited) and no worker holds them")
        self._weights_ref = peers[0].actor.state_dict.remote()
        return await actor.update_weights.remote(self._weights_ref)

    # -- status and shutdown -----------------------------------------------------------------------

    def worker_stats(self) -> list[dict]:
        return [{"index": s.index, "state": s.state, "in_flight": s.in_flight, "completed": s.completed,
                 "restarts": s.restarts, "error": s.error, "pid": s.info.get("pid")} for s in self.slots]

    async def shutdown(self) -> None:
        self.closed = True
        for slot in self.slots:
            if slot.actor is not None:
                try:
                    ray.kill(slot.actor)
                except Exception:
                    pass
            if slot.placement is not None:
                release(slot.placement)
                slot.placement = None
            slot.state = "stopped"
        if self.cond is not None:
            async with self.cond:
                self.cond.notify_all()
