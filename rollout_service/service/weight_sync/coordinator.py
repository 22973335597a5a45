"""The pool's side of every push: which workers take it, when it takes effect, and what the pool adopts.

An object-store push (switch) hands every worker the same object; a bucketed push is begun (checked
against the model, the workers drained and waiting for the sender) and ended (every worker's verdict).
Either way the pool adopts a push once a worker verifiably loaded it, restarts the workers that failed
it, and a push no worker loaded changes nothing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ray.exceptions import RayActorError, RayTaskError

from rollout_service.lora import push_digest
from rollout_service.service.ray_cluster import original_error
from rollout_service.service.current_weights import FROM_PEER
from rollout_service.service.supervisor import WorkerSupervisor
from rollout_service.service.switch_modes import DRAIN, check_switch_mode
from rollout_service.service.worker_slot import WorkerSlot
from rollout_service.weights import WeightMismatchError

from .groups import BroadcastGroups
from .plan import SyncPlan

log = logging.getLogger(__name__)


class PushCoordinator:
    """exclusive(): an async context in which no request is dispatched and none is in flight (the pool's
    drain); one_at_a_time(): the pool's lock that orders pushes in the other switch modes."""

    def __init__(self, workers: WorkerSupervisor, exclusive: Callable, one_at_a_time: Callable):
        self.workers, self._exclusive, self._one_at_a_time = workers, exclusive, one_at_a_time
        # new requests go only to workers holding this version or later: the one being pushed while a
        # push switches worker by worker, else the adopted one
        self.min_version = 0
        self._sync = None  # (plan, slots, exclusive block, workers' end calls) of the bucketed push in progress
        self._groups = BroadcastGroups()

    def _receivers(self) -> list[WorkerSlot]:
        slots = self.workers.receivers()
        if not slots:
            raise RuntimeError(self.workers.unavailable() if self.workers.all_failed()
                               else "no rollout worker is ready to take weights (all are restarting)")
        return slots

    # -- object-store pushes ---------------------------------------------------------------------

    async def switch(self, ref, expected: str, mode: str = DRAIN) -> str:
        """Every worker to the weights of `ref` (an ObjectRef each worker fetches), when `mode` says
        (service/switch_modes.py). Each worker checks them before loading anything."""
        # drain: nothing dispatched and nothing in flight meanwhile; the other modes: pushes one at a time
        async with (self._exclusive() if check_switch_mode(mode) == DRAIN else self._one_at_a_time()):
            slots = self._receivers()
            cannot = [s.index for s in slots if mode not in s.info.get("switch_modes", ())]
            if cannot:
                raise ValueError(f"rollout workers {cannot} cannot switch weights {mode!r} (their engine "
                                 f"recomputes no KV on a switch); use mode='drain' or 'finish-then-switch'")
            version = self.workers.weight_version + 1
            self.min_version = version  # new requests wait for a worker on the new weights
            try:
                causes = await asyncio.gather(*(self._switch_one(
                    s, s.actor.update_weights.remote(ref, expected, version, mode), expected, version) for s in slots))
                return await self._settle(slots, causes, expected, ref)
            finally:
                await self._settled_version()

    async def switch_adapter(self, name: str, ref, expected: str | None, adapter_digest: str) -> str:
        """Every worker to serve the LoRA adapter of `ref` (a LoraAdapter each worker fetches) as `name`,
        drained. Each worker checks it (against its base, and `expected`: push_digest of adapter and
        base) before serving it; returns push_digest(adapter_digest, the pool's base digest)."""
        async with self._exclusive():
            slots = self._lora_receivers()
            version = self.workers.weight_version + 1
            self.min_version = version
            want = push_digest(adapter_digest, self.workers.digest)
            try:
                causes = await asyncio.gather(*(self._switch_one(
                    s, s.actor.load_adapter.remote(name, ref, expected, version), want, version) for s in slots))
                return await self._settle(slots, causes, want, ref,
                                          adopt=lambda source, _: self.workers.adopt_adapter(name, source, adapter_digest))
            finally:
                await self._settled_version()

    def _lora_receivers(self) -> list[WorkerSlot]:
        slots = self._receivers()
        cannot = [s.index for s in slots if not getattr(s.info.get("capabilities"), "lora_adapters", False)]
        if cannot:
            raise ValueError(f"rollout workers {cannot} serve no LoRA adapters (their engine cannot)")
        return slots

    async def _settled_version(self) -> None:
        async with self.workers.cond:
            self.min_version = self.workers.weight_version
            self.workers.cond.notify_all()

    async def _switch_one(self, slot: WorkerSlot, call, expected: str, version: int):
        """One worker's switch (`call`: its pending remote call); it takes new requests as soon as it
        holds the new weights."""
        try:
            result = await call
        except RayTaskError as e:
            return e.cause
        except Exception as e:  # RayActorError: the worker died
            return e
        if result == expected:
            async with self.workers.cond:
                slot.weight_version = version
                self.workers.cond.notify_all()
        return result

    async def _settle(self, slots: list[WorkerSlot], results: list, expected: str, source, adopt=None) -> str:
        """Adopt a push that at least one worker verifiably loaded (adopt(source, expected); default: the
        pool's weights); restart the workers that failed it (they come back with what was adopted). A
        push no worker loaded changes nothing."""
        loaded = [s for s, r in zip(slots, results) if r == expected]
        refused = [(s, r) for s, r in zip(slots, results) if isinstance(r, WeightMismatchError)]
        if not loaded:
            for slot, result in zip(slots, results):
                if isinstance(result, RayActorError):
                    self.workers.on_dead(slot, slot.actor)
                elif not isinstance(result, WeightMismatchError):  # it may hold part of the push
                    self.workers.restart_later(slot, f"weight push failed ({result!r})")
            first = refused[0][1] if refused else next((r for r in results if isinstance(r, Exception)), None)
            if isinstance(first, WeightMismatchError):
                raise first
            raise RuntimeError(f"no worker loaded the weights: {results!r}")
        (adopt or self.workers.adopt_weights)(source, expected)
        self.min_version = self.workers.weight_version
        await self.workers.now_current(loaded)
        bad = []
        for slot, result in zip(slots, results):
            if isinstance(result, RayActorError):
                self.workers.on_dead(slot, slot.actor)  # its restart loads the new weights
            elif result != expected:
                what = f"error {result!r}" if isinstance(result, Exception) else f"digest {result}"
                bad.append(f"worker {slot.index}: {what}")
                self.workers.restart_later(slot, f"weight sync failed ({what})")
        if bad:
            log.warning("workers restarted after a weight push they did not complete: %s", bad)
        return expected

    # -- bucketed pushes: begin, the sender's buckets, end -----------------------------------------

    async def begin(self, wire: bytes) -> dict:
        """Check the push (a SyncPlan's wire form) against the model (names, shapes) before any worker is
        touched, then drain every ready worker and have it wait for the sender's buckets. Returns the
        workers (ipc: the sender calls them) and the process group's size (broadcast: the sender is
        rank 0)."""
        plan = SyncPlan.from_wire(wire)
        if self._sync is not None:
            raise RuntimeError("another weight push is in progress")
        start = time.perf_counter()
        exclusive = self._exclusive()
        await exclusive.__aenter__()
        try:
            slots, checked, results = await self._begin_workers(plan)
        except BaseException:
            self._groups.forget()
            await exclusive.__aexit__(None, None, None)
            raise
        # Rule: a push's end is asked of every worker now, while the sender sends, not when the sender
        # finishes: each answers once its receive has ended (broadcast) or its last bucket has been taken
        # (ipc) and it has adopted the push, so the sender's end waits for no further call to the workers.
        # A push that is not completed is ended by abandoning it (end).
        ends = [asyncio.ensure_future(s.actor.end_weight_receive.remote(plan.sync_id)) for s in slots]
        self._sync = (plan, slots, exclusive, ends)
        asyncio.get_running_loop().create_task(self._expire(plan.sync_id, plan.timeout_s))
        # where begin went: the pool's share (its checks, draining, the workers' begin), its checks, and
        # the slowest worker's own; the rest of the sender's begin is Ray's calls
        seconds = {"pool": time.perf_counter() - start, "checks": checked - start,
                   "worker": max(r["seconds"] for r in results)}
        # actor handles only where the sender calls the workers (ipc): each costs its call time to carry
        workers = [s.actor for s in slots] if plan.transport == "ipc" else []
        return {"workers": workers, "world_size": len(slots) + 1, "version": plan.version,
                "group_id": plan.group_id, "seconds": seconds, "new_group": plan.new_group,
                "store": (plan.store_host, plan.store_port), "replaces": self._groups.replaced_by(plan)}

    async def _begin_workers(self, plan: SyncPlan):
        """The pool's checks, then every worker's begin: (the workers, when the checks ended, their answers)."""
        plan.check(self.workers.spec)
        slots = self._lora_receivers() if plan.adapter is not None else self._receivers()
        if plan.transport == "ipc":  # by the workers' reports, before any is touched (each checks its
            # own device again when it opens the buffer: WeightReceiver.receive_ipc)
            elsewhere = [s.index for s in slots if s.info.get("gpu") != plan.gpu_uuid]
            if elsewhere:
                raise ValueError(f"transport='ipc' needs every worker on the sender's GPU; workers {elsewhere} "
                                 f"are not (use 'broadcast')")
        checked = time.perf_counter()
        plan.version = self.workers.weight_version + 1
        world = len(slots) + 1
        if plan.transport == "broadcast":
            self._groups.assign(plan, tuple(s.actor._actor_id.hex() for s in slots))
        wire = plan.to_wire()  # with the pool's version and group
        results = await asyncio.gather(*(s.actor.begin_weight_receive.remote(wire, i + 1, world)
                                         for i, s in enumerate(slots)), return_exceptions=True)
        failed = [(s, r) for s, r in zip(slots, results) if isinstance(r, Exception)]
        if failed:
            if plan.transport != "broadcast":
                await asyncio.gather(*(s.actor.end_weight_receive.remote(plan.sync_id, "begin failed")
                                       for s, r in zip(slots, results) if not isinstance(r, Exception)),
                                     return_exceptions=True)
            for slot, r in zip(slots, results):
                if isinstance(r, RayActorError):
                    self.workers.on_dead(slot, slot.actor)
                elif not isinstance(r, Exception) and plan.transport == "broadcast":
                    # it waits in a collective that will never run: only a replacement mends that
                    self.workers.restart_later(slot, "a weight push failed to begin on another worker")
            raise original_error(failed[0][1])
        return slots, checked, results

    async def end(self, sync_id: str, error: str | None = None, digest: str | None = None,
                  declined: bool = False) -> dict:
        """Every worker's verdict: adopt the push, or (error: the sender gave up) keep the old weights,
        restarting any worker that holds part of it. digest: the sender's (a plan carries none: its
        fingerprints came with the go). declined: the sender refused the push and told every worker
        so (a broadcast's header; an ipc push whose go never came); they answer having loaded nothing,
        and none is restarted. Returns {"digest": the digest adopted, "worker_seconds": each phase of
        the workers' share (WeightReceiver.seconds), the slowest's, "seconds": this call's own}."""
        if self._sync is None or self._sync[0].sync_id != sync_id:
            raise RuntimeError(f"no weight push {sync_id!r} in progress (it may have timed out)")
        plan, slots, exclusive, ends = self._sync
        self._sync = None
        start = time.perf_counter()
        try:
            if plan.digest is None:
                plan.digest = digest
            if plan.digest is None and error is None:
                error = "the sender's end of the push carried no digest"
            if plan.transport == "ipc":
                if error is None:  # the sender's last bucket call has returned: each worker adopts, or has
                    _, waiting = await asyncio.wait(ends, timeout=plan.timeout_s)
                    if waiting:
                        error = "the sender ended the push before its last bucket reached every worker"
                if error is not None:  # no more buckets will come: the workers answer having loaded nothing,
                    # or raise, holding part of the push (restarted below)
                    await asyncio.gather(*(s.actor.abandon_weight_receive.remote(sync_id, error)
                                           for s, t in zip(slots, ends) if not t.done()), return_exceptions=True)
            if plan.transport == "ipc" or error is None or declined:
                results = await asyncio.gather(*ends, return_exceptions=True)
            else:  # a worker that has not answered waits in a broadcast the sender will not finish
                results = [_outcome(t, RuntimeError("it was still receiving the abandoned push")) for t in ends]
            results = [r.cause if isinstance(r, RayTaskError) else r for r in results]
            seconds: dict[str, float] = {}
            for r in results:
                for phase, s in (r["seconds"].items() if isinstance(r, dict) else ()):
                    seconds[phase] = max(s, seconds.get(phase, 0.0))
            results = [r["digest"] if isinstance(r, dict) else r for r in results]
            if (error is not None and not declined) or any(isinstance(r, Exception) for r in results):
                self._groups.forget()  # a member failed mid-push: the next push sets up a new group
            if error is not None:
                for slot, r in zip(slots, results):
                    if r is not None:
                        self.workers.restart_later(slot, f"an abandoned push left part of it loaded ({r!r})")
                raise RuntimeError(f"weight push abandoned: {error}")
            if plan.adapter is None:
                digest = await self._settle(slots, results, plan.digest, FROM_PEER)
            else:  # an adapter push: adopted as the adapter of its name; its digest with the base's
                name = plan.adapter["name"]
                await self._settle(slots, results, plan.digest, FROM_PEER,
                                   adopt=lambda source, d: self.workers.adopt_adapter(name, source, d))
                digest = push_digest(plan.digest, self.workers.digest)
            return {"digest": digest, "worker_seconds": seconds, "seconds": time.perf_counter() - start}
        finally:
            await exclusive.__aexit__(None, None, None)

    async def _expire(self, sync_id: str, timeout_s: float) -> None:
        """A sender that never ends its push (it died) must not hold the pool forever."""
        await asyncio.sleep(timeout_s + 30)
        if self._sync is not None and self._sync[0].sync_id == sync_id:
            log.warning("weight push %s did not end within %.0f s: abandoning it", sync_id, timeout_s)
            try:
                await self.end(sync_id, error="the sender did not finish in time")
            except RuntimeError:
                pass


def _outcome(task: asyncio.Future, pending: Exception):
    """A call's result or error where it has ended, else `pending`; its later end is let go unread."""
    if not task.done():
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return pending
    if task.cancelled():
        return pending
    return task.exception() or task.result()
