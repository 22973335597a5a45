"""A worker's bucketed pushes, one at a time, as the pool and the sender drive them:

    begin    the worker stops serving (drained) and waits for the sender: by broadcast its engine
             thread waits in the group's first broadcast (the header); by ipc for the bucket calls
    bucket   ipc only: the sender's call with bucket `index` (the first carries the fingerprints, the go)
    abandon  ipc only: the pool's word that no more buckets will come
    end      asked by the pool right after begin; answers once the receive has ended (broadcast) or
             the last bucket was taken or the push abandoned (ipc): the push adopted (its digest), or
             nothing loaded (digest None), or an error when the engine holds part of it (the pool
             restarts the worker). The worker serves again.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from rollout_service.lora import LoraAdapter

from .plan import SyncPlan
from .receiver import WeightReceiver


class PushInbox:
    """The receive side of a worker's pushes. on_engine_thread(fn, *args) runs fn on the engine's one
    thread (an awaitable); hold() (async) stops the worker serving once its engine holds no request,
    release() lets it serve again; wake and set_version run on the engine thread (a sleeping engine
    woken; the version later tokens are stamped with)."""

    def __init__(self, engine, on_engine_thread: Callable[..., Awaitable], hold: Callable[[], Awaitable],
                 release: Callable[[], None], wake: Callable[[], None], set_version: Callable[[int], None]):
        self._engine, self._on_engine_thread = engine, on_engine_thread
        self._hold, self._release, self._wake, self._set_version = hold, release, wake, set_version
        self._receiver: WeightReceiver | None = None  # the push in progress
        # what end waits for: broadcast, the engine thread's receive_all; ipc, the push's last bucket
        # call, or its abandonment
        self._receiving: asyncio.Future | None = None
        self._bucket_calls = 0  # ipc bucket calls of the push in progress not yet returned
        self._abandoned: str | None = None  # why the ipc push in progress was abandoned
        self._groups: dict[str, tuple] = {}  # broadcast groups kept between pushes (groups.py)
        self._ipc_buffers: dict = {}  # the sender's kept stage, opened by ipc, kept between pushes
        self._adapter_tensors: dict = {}  # an adapter push's tensors as they arrive

    async def begin(self, wire: bytes, rank: int, world_size: int) -> dict:
        """Drain, then wait for the sender's buckets (the plan: SyncPlan's wire form). Returns
        {"seconds": this call's own time}."""
        plan = SyncPlan.from_wire(wire)
        start = time.perf_counter()
        # Rule: the engine is woken by the push's first load (on the engine thread), or before it by the
        # sender's wake once the rank's backward is over (WeightPush.wake), not here: an announced push
        # begins while a colocated rank trains, which the sleeping engine's memory is for
        await self._hold()
        try:
            if not self._engine.capabilities().bucketed_push:
                raise ValueError("this worker's engine takes no bucketed pushes")
            if plan.new_group:  # a worker serves one pool: a new group replaces any it held
                self._groups.clear()
            engine = self._engine
            if plan.adapter is not None and not engine.capabilities().lora_adapters:
                raise ValueError("this worker's engine serves no LoRA adapters")
            # an adapter's tensors are kept apart (copied: the buffer is the sender's, or reused) and
            # served as the adapter once all have arrived and been checked (_adopt)
            self._adapter_tensors = {}
            load = engine.load_named_weights if plan.adapter is None else (
                lambda named: self._adapter_tensors.update({n: t.clone() for n, t in named}))
            self._receiver = WeightReceiver(plan, engine.device, load, rank, world_size,
                                            self._groups, engine.wait_host_copies, self._ipc_buffers, wake=self._wake)
            self._receiving = self._on_engine_thread(self._receiver.receive_all) \
                if plan.transport == "broadcast" else asyncio.get_running_loop().create_future()
            self._bucket_calls, self._abandoned = 0, None
            return {"seconds": time.perf_counter() - start}
        except BaseException:
            self._receiver = self._receiving = None
            self._release()
            raise

    async def bucket(self, sync_id: str, index: int, handle, fingerprints: list | None, kept: bool) -> None:
        """ipc: bucket `index`, read from the sender's buffer (WeightReceiver.receive_ipc). The last bucket,
        taken, lets the pending end adopt the push; after a bucket that failed, the end waits for the
        pool's abandon (the sender gives the push up on the failure it gets back)."""
        receiver = self._current(sync_id)
        if self._abandoned is not None:
            raise RuntimeError(f"the push was abandoned: {self._abandoned}")
        start = time.perf_counter()
        self._bucket_calls += 1
        taken = False
        try:
            await self._on_engine_thread(receiver.receive_ipc, index, handle, fingerprints, kept)
            taken = True
        finally:
            self._bucket_calls -= 1
            receiver.seconds["call"] = receiver.seconds.get("call", 0.0) + time.perf_counter() - start
            if (taken and index == len(receiver.plan.buckets) - 1) or \
                    (self._abandoned is not None and self._bucket_calls == 0):
                self._received_all()

    async def abandon(self, sync_id: str, reason: str) -> None:
        """ipc: no more buckets will come (the sender gave up or declined, or the push timed out). The
        pending end then answers as for an abandoned push, once any bucket call still on the engine
        thread has returned. A no-op once this worker's end has answered."""
        if self._receiver is None or self._receiver.plan.sync_id != sync_id or self._abandoned is not None:
            return
        self._abandoned = reason
        if self._bucket_calls == 0:
            self._received_all()

    def _received_all(self) -> None:
        if self._receiving is not None and not self._receiving.done():
            self._receiving.set_result(None)

    async def end(self, sync_id: str, error: str | None = None) -> dict:
        """{"digest": the digest now held, after checking that everything arrived, "seconds": where this
        worker's share of the push went}; digest None if nothing was loaded, with `error` (the sender gave
        up; by ipc also abandon's reason) or after a header's no-go. Raises if the engine holds part of
        the push (the pool restarts the worker)."""
        receiver = self._current(sync_id)
        if receiver.plan.transport == "ipc" and error is not None:  # no end was asked at begin (it failed)
            await self.abandon(sync_id, error)
        if error is not None and receiver.plan.transport == "broadcast" and not self._receiving.done():
            # the engine thread waits in a broadcast the sender will not finish: not this actor's to mend
            raise RuntimeError(f"the push was abandoned while this worker was receiving it: {error}")
        try:
            try:
                if self._receiving is not None:
                    await self._receiving
                error = error if error is not None else self._abandoned
                if error is None and not receiver.declined:
                    return await self._on_engine_thread(self._adopt, receiver)
            except Exception as e:
                if self._holds_part(receiver):  # the engine holds part of the push: only a restart mends that
                    raise RuntimeError(f"this worker loaded part of the push, then: {e!r}") from e
                raise
            if self._holds_part(receiver):
                raise RuntimeError(f"the push was abandoned after part of it was loaded: {error}")
            return {"digest": None, "seconds": receiver.seconds}
        finally:
            self._receiver = self._receiving = self._abandoned = None
            self._adapter_tensors = {}
            self._release()

    @staticmethod
    def _holds_part(receiver: WeightReceiver) -> bool:
        """Whether the engine holds part of the push: an adapter's tensors reach it only whole (_adopt)."""
        return receiver.loaded_any and receiver.plan.adapter is None

    def _adopt(self, receiver: WeightReceiver) -> dict:
        """On the engine thread, in one call: the push checked complete, the engine's load finished and
        the version taken (end's result)."""
        digest = receiver.finish()
        start = time.perf_counter()
        adapter = receiver.plan.adapter
        if adapter is None:
            self._engine.finish_weight_load()
        else:
            self._engine.load_adapter(adapter["name"], LoraAdapter.from_settings(adapter, self._adapter_tensors),
                                      adapter["expected"], receiver.plan.version)
        self._set_version(receiver.plan.version)
        return {"digest": digest, "seconds": {**receiver.seconds, "engine": time.perf_counter() - start}}

    def _current(self, sync_id: str) -> WeightReceiver:
        if self._receiver is None or self._receiver.plan.sync_id != sync_id:
            raise RuntimeError(f"no weight push {sync_id!r} in progress on this worker")
        return self._receiver
