"""Supervision of a pool's RolloutWorker actors: start them (each in its own placement group when
asked), watch each for death, restart a dead or out-of-sync worker with the pool's current weights,
and shut them down. The pool actor (pool.py) routes requests over the workers kept "ready" here.
"""
from __future__ import annotations

import asyncio
import logging

import ray
from ray.exceptions import RayActorError

import kernels as K
from rollout_service.ray_placement import on_bundle, release, reserve
from rollout_service.service import prefix_cache_stats
from rollout_service.service.ray_cluster import original_error, placement_report, worker_resources
from rollout_service.service.current_weights import CurrentWeights, NoCurrentWeights
from rollout_service.service.worker import RolloutWorker
from rollout_service.service.worker_slot import WorkerSlot
from rollout_service.weights import WeightMismatchError

log = logging.getLogger(__name__)

# Concurrent calls an async actor accepts; requests beyond the engine's batch wait inside it.
MAX_CONCURRENCY = 100_000

# Restarts: a slot is never given up for a failure that may pass (a death, a lost object, a
# replacement killed while it started); each failed replacement is logged and shown in stats(),
# and the next one comes after a back-off that doubles up to RESTART_BACKOFF_MAX_S. A slot is given
# up ("failed") only when a replacement shows that it can never serve: its canonical contract differs
# from the pool's (another tree width or kernel family, e.g. after an environment change).
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0



class WorkerSupervisor:
    """The workers of one pool and the weights every one of them must hold (`digest`)."""

    def __init__(self, num_workers: int, engine_kwargs: dict | None, resources_per_worker: dict | None,
                 placement_group_bundles: list[dict] | None, placement_strategy: str, colocate_with=None):
        self._colocate_with = colocate_with  # a caller's placement group: worker i on its bundle i
        self._engine_kwargs = dict(engine_kwargs or {})
        if resources_per_worker is None and placement_group_bundles:
            # by default the worker takes exactly its bundle (bundle 0) of the group
            first = placement_group_bundles[0]
            resources_per_worker = {"num_cpus": first.get("CPU", 0), "num_gpus": first.get("GPU", 0)}
        self._resources = worker_resources(resources_per_worker)
        self._bundles = placement_group_bundles
        self._strategy = placement_strategy
        self.slots = [WorkerSlot(i) for i in range(num_workers)]
        self._model = None  # model path, or an ObjectRef of the model
        self.current = CurrentWeights()  # what restarts load: the weights last adopted, the LoRA adapters
        self.digest = None
        self.spec = None  # name -> shape of the weights every push must carry (None: TP workers)
        self.canonical = None  # kernels.CanonicalConfig of every worker
        self._version = 0
        self.closed = False
        # notified on every worker state change (and by the pool when its in-flight count drops)
        self.cond: asyncio.Condition | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, model_box: list, detached: bool, timeout_s: float) -> dict:
        """model_box: [a local path, or an ObjectRef of the model] (boxed: this actor never loads it).
        Raises TimeoutError naming the resources asked for and free when the workers are not ready
        within timeout_s, and a worker's own error (its type and message) when one fails to start."""
        self.cond = asyncio.Condition()
        self._model = model_box[0]

        async def start_one(slot):
            return await (await self._spawn(slot)).ready.remote()
        try:
            infos = await asyncio.wait_for(asyncio.gather(*(start_one(s) for s in self.slots),
                                                          return_exceptions=True), timeout_s)
        except asyncio.TimeoutError:
            pending = sum(1 for s in self.slots if not s.info)
            report = placement_report(pending, len(self.slots), self._bundles, self._resources, timeout_s)
            await self.shutdown()
            raise TimeoutError(report) from None
        for slot, info in zip(self.slots, infos):
            if isinstance(info, Exception):
                await self.shutdown()
                raise original_error(info)
            slot.info = info
        digests = {info["digest"] for info in infos}
        if len(digests) != 1:
            await self.shutdown()
            raise WeightMismatchError(f"workers loaded the same model with different digests: {digests}")
        self.digest = digests.pop()
        self.spec = self.slots[0].info.get("spec")
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

    def recover(self, state: dict) -> None:
        """A restarted pool actor (its workers died with it): every worker restarts, as a dead one does,
        with what the pool's keeper held (pool_keeper.PoolKeeper.incarnation): the model, the weights of
        `digest` as weight `version`, and the adapters."""
        self.cond = asyncio.Condition()
        self._model = state["model"]
        self.digest, self._version = state["digest"], state["version"]
        self.spec, self.canonical = state["spec"], state["canonical"]
        self.current.restore(state["weights"], state["adapters"])
        for slot, placement in zip(self.slots, state["placements"]):
            slot.placement = _still_reserved(placement)  # the dead incarnation's reservation, reused
            slot.weight_version = self._version
            self.restart_later(slot, "the rollout pool's actor restarted")

    def placements(self) -> list:
        """Each slot's placement group (None without one): a restarted pool reuses them (they outlive the
        actor that reserved them)."""
        return [slot.placement for slot in self.slots]

    def kept_sources(self) -> tuple:
        """(version, digest, weights source, adapter sources) for the pool's keeper, read at one instant;
        a ready worker holding this version copies what no object holds (CurrentWeights.sources)."""
        peer = next((s.actor for s in self.ready() if s.weight_version == self._version), None)
        return (self._version, self.digest, *self.current.sources(peer))

    # -- which workers can take work ---------------------------------------------------------------

    def ready(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.state == "ready"]

    def receivers(self) -> list[WorkerSlot]:
        """The workers a weight push goes to: the ready ones and the stale ones (alive, waiting for it)."""
        return [s for s in self.slots if s.state in ("ready", "stale")]

    def all_failed(self) -> bool:
        return all(s.state == "failed" for s in self.slots)

    def none_can_serve(self) -> bool:
        """No worker serves now or will without a weight push (none ready, starting or restarting)."""
        return all(s.state in ("failed", "stale", "stopped") for s in self.slots)

    async def now_current(self, slots: list[WorkerSlot]) -> None:
        """These workers verifiably hold the current weights: stale ones serve again, and a worker that
        became ready with older weights (it restarted while the push ran) is restarted with these."""
        for slot in slots:
            slot.weight_version = self._version
            if slot.state == "stale":
                await self._set_state(slot, "ready")
        for slot in self.ready():
            if slot.weight_version < self._version:
                self.restart_later(slot, "restarted with older weights while a push was adopted")

    def unavailable(self) -> str:
        if self.closed:
            return "the rollout pool is shut down"
        return "no healthy rollout workers: " + "; ".join(
            f"worker {s.index}: {s.error}" for s in self.slots if s.error)

    # -- deaths and restarts -----------------------------------------------------------------------

    def on_dead(self, slot: WorkerSlot, actor):
        if self.closed or slot.actor is not actor or slot.state not in ("ready", "stale"):
            return  # already known, or an older incarnation
        self.restart_later(slot, "died")

    def restart_later(self, slot: WorkerSlot, reason: str):
        """Out of rotation now; back when a replacement verifiably holds the current weights."""
        slot.state = "restarting"
        self._spawn_task(self._restart(slot, reason))

    def adopt_weights(self, weights_ref, digest: str) -> None:
        """The weights every worker must hold from now on (restarts load them): an ObjectRef, or
        FROM_PEER after a push that reached the workers directly. Called only once they are verified."""
        self.current.weights, self.digest = weights_ref, digest
        self._version += 1

    def adopt_adapter(self, name: str, source, adapter_digest: str) -> None:
        """Adapter `name` every worker serves from now on (restarts load it): an ObjectRef of the
        LoraAdapter, or FROM_PEER. A new weight version, as a push of the weights is."""
        self.current.adopt_adapter(name, source, adapter_digest)
        self._version += 1

    @property
    def weight_version(self) -> int:
        """How many pushes the pool has adopted: 0 for the weights it started with, +1 per adopted push."""
        return self._version

    async def _spawn(self, slot: WorkerSlot):
        if self.closed:
            raise RuntimeError("the rollout pool is shut down")
        opts = dict(self._resources, max_concurrency=MAX_CONCURRENCY)
        if self._colocate_with is not None:
            opts["scheduling_strategy"] = on_bundle(self._colocate_with, slot.index)
        elif self._bundles:
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
        """Replace the slot's worker until a replacement holds the current weights (see RESTART_BACKOFF_S)."""
        delay = RESTART_BACKOFF_S
        while True:
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
                try:
                    while True:  # load the current weights; again if they change meanwhile
                        version, expected = self._version, self.digest
                        digest = await self._load_current(actor, slot, version)
                        if version == self._version:
                            break
                except NoCurrentWeights as e:
                    slot.restarts += 1
                    await self._set_state(slot, "stale", f"{reason}; waiting for the next weight push: {e}")
                    log.warning("rollout worker %d is waiting for the next weight push: %s", slot.index, e)
                    self._watch(slot)
                    return
                if digest != expected:
                    raise WeightMismatchError(f"restarted worker {slot.index} has digest {digest}, expected {expected}")
                if self.closed:
                    ray.kill(actor)
                    return
                slot.restarts += 1
                slot.failed_restarts = 0
                slot.weight_version = version
                await self._set_state(slot, "ready")
                self._watch(slot)
                return
            except Exception as e:
                e = original_error(e)
                slot.failed_restarts += 1
                if isinstance(e, K.CanonicalMismatchError):  # no replacement can ever serve in this pool
                    log.error("rollout worker %d given up: %s", slot.index, e)
                    await self._set_state(slot, "failed", f"{reason}; given up: {e}")
                    return
                slot.error = (f"{reason}; replacement {slot.failed_restarts} failed ({type(e).__name__}: {e}); "
                              f"next try in {delay:.1f} s")
                log.warning("rollout worker %d: %s", slot.index, slot.error)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESTART_BACKOFF_MAX_S)

    async def _load_current(self, actor, slot: WorkerSlot, version: int) -> str:
        peers = [s.actor for s in self.slots if s.state == "ready" and s is not slot]
        return await self.current.load_into(actor, slot.index, self.digest, version, peers)

    # -- status and shutdown -----------------------------------------------------------------------

    def worker_stats(self) -> list[dict]:
        return [{"index": s.index, "state": s.state, "in_flight": s.in_flight, "completed": s.completed,
                 "restarts": s.restarts, "failed_restarts": s.failed_restarts, "error": s.error,
                 "weight_version": s.weight_version, "pid": s.info.get("pid"), "gpu": s.info.get("gpu"),
                 "gpu_ids": s.info.get("gpu_ids", []), "prefix_cache": prefix_cache_stats.slot_counts(s)}
                for s in self.slots]

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


def _still_reserved(placement):
    """`placement` (a placement group, or None) if Ray still holds it, else None (the slot reserves anew)."""
    from ray.util.placement_group import placement_group_table
    if placement is None:
        return None
    try:
        state = placement_group_table(placement).get("state")
    except Exception:
        return None
    return None if state in (None, "REMOVED") else placement
