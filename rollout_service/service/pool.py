"""The rollout pool: a named Ray actor that routes requests over RolloutWorker actors (start_pool).

Outputs are a pure function of (weights, prompt, params, seed), so the pool may send a request to
any worker, and re-run it elsewhere when its worker dies, without changing a single bit. The workers
themselves (start, death, restart with the current weights) are supervisor.WorkerSupervisor's.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from rollout_service.engine.config import split_worker_options
from rollout_service.engine.engine import check_model_source
from rollout_service.service.client import DEFAULT_NAMESPACE, RolloutClient, ensure_ray
from rollout_service.service.ray_cluster import original_error
from rollout_service.service.supervisor import FROM_PEER, MAX_CONCURRENCY, WorkerSlot, WorkerSupervisor
from rollout_service.service.switch_modes import DRAIN, check_switch_mode
from rollout_service.service.weight_sync import SyncPlan
from rollout_service.service.worker import EarlyCancels, abort_rollout, error_rollout
from rollout_service.weights import WeightMismatchError

log = logging.getLogger(__name__)


class _PoolActor:
    """Routing: each request to the least-loaded ready worker, retried elsewhere when its worker dies;
    cancellation; the weight barrier (no request is dispatched while weights are swapped); counts.
    Lives in a named actor so that any driver can find it."""

    def __init__(self, num_workers: int, engine_kwargs: dict | None, resources_per_worker: dict | None,
                 placement_group_bundles: list[dict] | None, placement_strategy: str, max_retries: int,
                 colocate_with=None):
        self.workers = WorkerSupervisor(num_workers, engine_kwargs, resources_per_worker, placement_group_bundles,
                                        placement_strategy, colocate_with)
        self._max_retries = max_retries
        self._in_flight = 0
        self._active: dict[str, WorkerSlot | None] = {}
        self._cancelled: set[str] = set()
        self._early_cancels = EarlyCancels()
        self._counts = {"submitted": 0, "completed": 0, "errors": 0, "aborted": 0, "retried": 0}
        self._gate: asyncio.Event | None = None  # cleared while weights are being swapped (drain)
        # new requests go only to workers holding this version or later: the one being pushed while a
        # push switches worker by worker, else the adopted one
        self._min_version = 0
        self._update_lock: asyncio.Lock | None = None
        self._sync = None  # (plan, slots, exclusive block, workers' end calls) of the bucketed push in progress
        self._broadcast_group = None  # (group id, sender id, members, store, timeout) of the last broadcast group
        self._dropped_groups: list[str] = []  # groups replaced or given up since, for the sender to drop

    async def start(self, model_box: list, detached: bool, timeout_s: float) -> dict:
        self._gate, self._update_lock = asyncio.Event(), asyncio.Lock()
        self._gate.set()
        return await self.workers.start(model_box, detached, timeout_s)

    async def _pick(self) -> WorkerSlot | None:
        """The ready worker with the fewest requests in flight; waits while none is ready."""
        cond = self.workers.cond
        async with cond:
            while True:
                if self.workers.closed:
                    return None
                ready = [s for s in self.workers.ready() if s.weight_version >= self._min_version]
                if ready:
                    return min(ready, key=lambda s: (s.in_flight, s.completed))
                if self.workers.none_can_serve():
                    return None
                await cond.wait()

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
                        return self._count(error_rollout(prompt, self.workers.unavailable()))
                    if self._gate.is_set():
                        break
                actor = slot.actor
                slot.in_flight += 1
                self._in_flight += 1
                self._active[key] = slot
                try:  # the worker stamps each token with the version of the weights that produced it
                    rollout = await actor.generate.remote(key, prompt, params)
                    slot.completed += 1
                    return self._count(rollout)
                except RayActorError as e:  # the worker died: run the request again elsewhere
                    failures.append(f"worker {slot.index}: {type(e).__name__}")
                    self._counts["retried"] += 1
                    self.workers.on_dead(slot, actor)
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
                        async with self.workers.cond:
                            self.workers.cond.notify_all()
            return self._count(error_rollout(prompt, f"request failed on {len(failures)} workers: {failures}"))
        finally:
            del self._active[key]
            self._cancelled.discard(key)

    def _count(self, rollout):
        reason = rollout.finish_reason
        self._counts["errors" if reason == "error" else "aborted" if reason == "abort" else "completed"] += 1
        return rollout

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

    async def update_weights(self, weights_box: list, expected: str, mode: str = DRAIN) -> str:
        """Swap every worker to the weights in `weights_box[0]` (one ObjectRef, fetched by each worker
        from the object store), when `mode` says (service/switch_modes.py). Each worker checks them
        (names, shapes, finite values, the `expected` digest) before loading anything; the pool adopts
        them once every worker has answered, so a refused push leaves every worker on the weights it had."""
        ref = weights_box[0]
        # drain: nothing dispatched and nothing in flight meanwhile; the other modes: pushes one at a time
        async with (self._exclusive() if check_switch_mode(mode) == DRAIN else self._update_lock):
            slots = self._sync_slots()
            cannot = [s.index for s in slots if mode not in s.info.get("switch_modes", ())]
            if cannot:
                raise ValueError(f"rollout workers {cannot} cannot switch weights {mode!r} (their engine "
                                 f"recomputes no KV on a switch); use mode='drain' or 'finish-then-switch'")
            version = self.workers.weight_version + 1
            self._min_version = version  # new requests wait for a worker on the new weights
            try:
                causes = await asyncio.gather(*(self._switch_one(s, ref, expected, version, mode) for s in slots))
                return await self._settle(slots, causes, expected, ref)
            finally:
                async with self.workers.cond:
                    self._min_version = self.workers.weight_version
                    self.workers.cond.notify_all()

    async def _switch_one(self, slot: WorkerSlot, ref, expected: str, version: int, mode: str):
        """One worker's switch; it takes new requests as soon as it holds the new weights."""
        try:
            result = await slot.actor.update_weights.remote(ref, expected, version, mode)
        except RayTaskError as e:
            return e.cause
        except Exception as e:  # RayActorError: the worker died
            return e
        if result == expected:
            async with self.workers.cond:
                slot.weight_version = version
                self.workers.cond.notify_all()
        return result

    async def _settle(self, slots: list[WorkerSlot], results: list, expected: str, source) -> str:
        """Adopt a push that at least one worker verifiably loaded; restart the workers that failed it
        (they come back with the adopted weights). A push no worker loaded changes nothing."""
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
        self.workers.adopt_weights(source, expected)
        self._min_version = self.workers.weight_version
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

    @contextlib.asynccontextmanager
    async def _exclusive(self):
        """No request is dispatched inside this block and none is in flight."""
        async with self._update_lock:
            self._gate.clear()
            try:
                async with self.workers.cond:
                    await self.workers.cond.wait_for(lambda: self._in_flight == 0)
                yield
            finally:
                self._gate.set()

    def _sync_slots(self) -> list[WorkerSlot]:
        slots = self.workers.receivers()
        if not slots:
            raise RuntimeError(self.workers.unavailable() if self.workers.all_failed()
                               else "no rollout worker is ready to take weights (all are restarting)")
        return slots

    # bucketed pushes (weight_sync.WeightSender): begin, the sender's buckets, end
    async def begin_weight_sync(self, wire: bytes) -> dict:
        """Check the push (a SyncPlan's wire form) against the model (names, shapes, digest) before any
        worker is touched, then drain every ready worker and have it wait for the sender's buckets.
        Returns the workers (ipc: the sender calls them) and the process group's size (broadcast: the
        sender is rank 0)."""
        plan = SyncPlan.from_wire(wire)
        if self._sync is not None:
            raise RuntimeError("another weight push is in progress")
        start = time.perf_counter()
        exclusive = self._exclusive()
        await exclusive.__aenter__()
        try:
            plan.check(self.workers.spec)
            slots = self._sync_slots()
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
                self._assign_group(plan, slots)
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
        except BaseException:
            self._forget_group()
            await exclusive.__aexit__(None, None, None)
            raise
        # Rule: a push's end is asked of every worker now, while the sender sends, not when the sender
        # finishes: each answers once its receive has ended (broadcast) or its last bucket has been taken
        # (ipc) and it has adopted the push, so the sender's end waits for no further call to the workers.
        # A push that is not completed is ended by abandoning it (end_weight_sync).
        ends = [asyncio.ensure_future(s.actor.end_weight_receive.remote(plan.sync_id)) for s in slots]
        self._sync = (plan, slots, exclusive, ends)
        asyncio.get_running_loop().create_task(self._expire_sync(plan.sync_id, plan.timeout_s))
        replaces, self._dropped_groups = (self._dropped_groups, []) if plan.new_group else ([], self._dropped_groups)
        # where begin went: the pool's share (its checks, draining, the workers' begin), its checks, and
        # the slowest worker's own; the rest of the sender's begin is Ray's calls
        seconds = {"pool": time.perf_counter() - start, "checks": checked - start,
                   "worker": max(r["seconds"] for r in results)}
        # actor handles only where the sender calls the workers (ipc): each costs its call time to carry
        workers = [s.actor for s in slots] if plan.transport == "ipc" else []
        return {"workers": workers, "world_size": world, "version": plan.version,
                "group_id": plan.group_id, "seconds": seconds,
                "new_group": plan.new_group, "store": (plan.store_host, plan.store_port), "replaces": replaces}

    def _assign_group(self, plan, slots: list[WorkerSlot]) -> None:
        """The last broadcast group when its members (the sender's process, these workers in this order)
        and its timeout are the same, else a new one at the sender's store. Rule: a group's operations
        time out after the timeout it was made with (join_group), so a push with another timeout_s
        needs a group of its own to be held to it."""
        members = tuple(s.actor._actor_id.hex() for s in slots)
        last = self._broadcast_group
        if last is not None and last[1:3] == (plan.sender_id, members) and last[4] == plan.timeout_s:
            plan.group_id, plan.new_group = last[0], False
            plan.store_host, plan.store_port = last[3]
        else:
            self._forget_group()
            plan.group_id, plan.new_group = uuid.uuid4().hex[:12], True
            self._broadcast_group = (plan.group_id, plan.sender_id, members, (plan.store_host, plan.store_port),
                                     plan.timeout_s)

    def _forget_group(self) -> None:
        if self._broadcast_group is not None:
            self._dropped_groups.append(self._broadcast_group[0])
            self._broadcast_group = None

    async def end_weight_sync(self, sync_id: str, error: str | None = None, digest: str | None = None,
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
                self._forget_group()  # a member failed mid-push: the next push sets up a new group
            if error is not None:
                for slot, r in zip(slots, results):
                    if r is not None:
                        self.workers.restart_later(slot, f"an abandoned push left part of it loaded ({r!r})")
                raise RuntimeError(f"weight push abandoned: {error}")
            digest = await self._settle(slots, results, plan.digest, FROM_PEER)
            return {"digest": digest, "worker_seconds": seconds, "seconds": time.perf_counter() - start}
        finally:
            await exclusive.__aexit__(None, None, None)

    async def _expire_sync(self, sync_id: str, timeout_s: float) -> None:
        """A sender that never ends its push (it died) must not hold the pool forever."""
        await asyncio.sleep(timeout_s + 30)
        if self._sync is not None and self._sync[0].sync_id == sync_id:
            log.warning("weight push %s did not end within %.0f s: abandoning it", sync_id, timeout_s)
            try:
                await self.end_weight_sync(sync_id, error="the sender did not finish in time")
            except RuntimeError:
                pass

    async def weights_digest(self) -> str:
        return self.workers.digest

    # -- status and shutdown ---------------------------------------------------------------------

    async def stats(self) -> dict:
        return {**self._counts, "in_flight": self._in_flight, "digest": self.workers.digest,
                "weight_version": self.workers.weight_version, "workers": self.workers.worker_stats()}

    async def sleep(self) -> None:
        """Every serving worker's engine releases its memory (see RolloutWorker.sleep)."""
        await asyncio.gather(*(s.actor.sleep.remote() for s in self.workers.receivers()))

    async def wake(self) -> None:
        await asyncio.gather(*(s.actor.wake.remote() for s in self.workers.receivers()))

    async def worker_handles(self) -> list:
        return [s.actor for s in self.workers.slots]

    async def shutdown(self) -> None:
        await self.workers.shutdown()
        if self._gate is not None:
            self._gate.set()


def _outcome(task: asyncio.Future, pending: Exception):
    """A call's result or error where it has ended, else `pending`; its later end is let go unread."""
    if not task.done():
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return pending
    if task.cancelled():
        return pending
    return task.exception() or task.result()


_PoolActorRemote = ray.remote(_PoolActor)


def start_pool(model, num_workers: int = 2, name: str = "rollout", engine_kwargs: dict | None = None,
               resources_per_worker: dict | None = None, placement_group_bundles: list[dict] | None = None,
               placement_strategy: str = "STRICT_PACK", namespace: str = DEFAULT_NAMESPACE, detached: bool = False,
               max_retries: int = 3, start_timeout_s: float = 120.0, colocate_with=None) -> RolloutClient:
    """Start `num_workers` RolloutWorker actors behind a pool actor named `name`; returns the owning
    client (`with start_pool(...) as pool:` shuts it down on exit).

    Other drivers and jobs reach the pool with RolloutClient(name). Workers are 1-CPU actors unless
    resources_per_worker (Ray actor options) says otherwise, e.g. {"num_gpus": 1}; a GPU worker's
    engine runs on "cuda" unless engine_kwargs names a device. placement_group_bundles (e.g.
    [{"GPU": 1, "CPU": 1}] * tp) gives each worker its own placement group (placement_strategy,
    STRICT_PACK: one node): the worker takes bundle 0, and actors it starts (tensor-parallel ranks)
    are captured in the group. colocate_with: a placement group of the caller's with a bundle per
    worker, e.g. one GPU each, that other actors share (a colocated trainer rank on each): worker i
    takes resources_per_worker out of bundle i. A detached pool outlives its creating driver; shut it down with
    RolloutClient(name).shutdown().

    It returns or raises within start_timeout_s: TimeoutError naming the resources each worker asks
    for and those the cluster has free when the workers cannot all be placed (or load) in time; a
    worker's own error (e.g. ValueError for a bad engine option) when one fails to start, with Ray's
    error and its remote traceback as __cause__. A missing path, unloadable config, unsupported
    architecture or truncated weights file is a FileNotFoundError / ValueError before any actor starts.
    """
    # checked here, at the call: inside the actor a bad value would surface as ActorDiedError
    if isinstance(num_workers, bool) or not isinstance(num_workers, int):
        raise TypeError(f"num_workers must be an int, got {type(num_workers).__name__}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not isinstance(model, (str, os.PathLike, torch.nn.Module)):
        raise TypeError(f"model must be a Hugging Face model, a local checkpoint path or 'tiny:<arch>', "
                        f"got {type(model).__name__}")
    split_worker_options(engine_kwargs)  # tensor_parallel_size / backend checked here, once
    if colocate_with is not None and (placement_group_bundles or len(colocate_with.bundle_specs) < num_workers):
        raise ValueError(f"colocate_with needs a bundle per worker ({num_workers}), has "
                         f"{len(colocate_with.bundle_specs)}, and excludes placement_group_bundles")
    check_model_source(model)  # a missing path, a bad config or a truncated file: raised here, at once
    ensure_ray()
    options = dict(name=name, namespace=namespace, num_cpus=0, max_concurrency=MAX_CONCURRENCY)
    if detached:
        options["lifetime"] = "detached"  # outlives this driver; shut it down explicitly
    try:
        actor = _PoolActorRemote.options(**options).remote(
            num_workers, engine_kwargs, resources_per_worker, placement_group_bundles,
            placement_strategy, max_retries, colocate_with)
    except ValueError as e:
        raise ValueError(f"cannot create rollout pool {name!r} in namespace {namespace!r}: {e}") from e
    if isinstance(start_timeout_s, bool) or not isinstance(start_timeout_s, (int, float)) or start_timeout_s <= 0:
        raise ValueError(f"start_timeout_s must be a number > 0, got {start_timeout_s!r}")
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=start_timeout_s)
        model_box = [model if isinstance(model, (str, os.PathLike)) else ray.put(model)]
        # the pool raises at start_timeout_s; this bound only guards against a pool actor that hangs
        info = ray.get(actor.start.remote(model_box, detached, float(start_timeout_s)), timeout=start_timeout_s + 60)
    except RayTaskError as e:
        ray.kill(actor)
        raise original_error(e) from e
    except BaseException:
        ray.kill(actor)
        raise
    return RolloutClient(name, namespace=namespace, _handle=actor, _info=info)
