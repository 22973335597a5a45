"""The rollout pool: a named Ray actor that routes requests over RolloutWorker actors (start_pool).

Outputs are a pure function of (weights, prompt, params, seed), so the pool may send a request to
any worker, and re-run it elsewhere when its worker dies, without changing a single bit. The workers
themselves (start, death, restart with the current weights) are supervisor.WorkerSupervisor's.

Rule (where the pool actor runs): on a node chosen, never where Ray's scheduler happens to put it: the
node of the driver that starts it (or `pool_node`), pinned (a hard node affinity), so that losing any
other node never loses the pool; its workers may run anywhere and are restarted on live nodes. A pool
started with max_restarts comes back after its own process dies, with the weights, version and adapters
it served (pool_keeper.py), and RolloutClient calls ride over the restart (client.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import os

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollout_service.engine.config import split_worker_options
from rollout_service.engine.model_loading import check_model_source
from rollout_service.engine.protocol import EngineCapabilities
from rollout_service.service import prefix_cache_stats
from rollout_service.service.client import DEFAULT_NAMESPACE, RolloutClient, ensure_ray
from rollout_service.service.pool_keeper import PoolKeeperRemote
from rollout_service.service.ray_cluster import original_error, placement_report, worker_resources
from rollout_service.service.request_outcomes import EarlyCancels, abort_rollout, error_rollout
from rollout_service.service.supervisor import MAX_CONCURRENCY, WorkerSupervisor
from rollout_service.service.switch_modes import DRAIN
from rollout_service.service.weight_sync.coordinator import PushCoordinator
from rollout_service.service.worker_slot import WorkerSlot


class _PoolActor:
    """Routing: each request to the least-loaded ready worker, retried elsewhere when its worker dies;
    cancellation; the weight barrier (no request is dispatched while weights are swapped); counts.
    Lives in a named actor so that any driver can find it. With a keeper (pool_keeper.PoolKeeper), a
    restarted incarnation of this actor recovers what the last one served before it answers any call."""

    def __init__(self, num_workers: int, engine_kwargs: dict | None, resources_per_worker: dict | None,
                 placement_group_bundles: list[dict] | None, placement_strategy: str, max_retries: int,
                 colocate_with=None, keeper=None):
        self.workers = WorkerSupervisor(num_workers, engine_kwargs, resources_per_worker, placement_group_bundles,
                                        placement_strategy, colocate_with)
        self._keeper = keeper
        self._restarts = 0  # times this pool's actor was restarted (from its keeper)
        self._kept_version = -1  # the weight version last recorded with the keeper
        self._max_retries = max_retries
        self._in_flight = 0
        self._active: dict[str, WorkerSlot | None] = {}
        self._cancelled: set[str] = set()
        self._early_cancels = EarlyCancels()
        self._counts = {"submitted": 0, "completed": 0, "errors": 0, "aborted": 0, "retried": 0}
        self._gate: asyncio.Event | None = None  # cleared while weights are being swapped (drain)
        self._update_lock: asyncio.Lock | None = None
        self._pushes = PushCoordinator(self.workers, self._exclusive, lambda: self._update_lock)
        # the recovery of a restarted incarnation (a no-op for the first), run on the actor's event loop
        self._recovery = None if keeper is None else asyncio.run_coroutine_threadsafe(
            self._recover(), asyncio.get_event_loop())

    async def _up(self) -> None:
        """Wait until a restarted incarnation has recovered (at once otherwise); every call starts here."""
        if self._recovery is not None:
            await asyncio.wrap_future(self._recovery)

    async def _recover(self) -> None:
        state = await self._keeper.incarnation.remote()
        if state is None:
            return  # the first incarnation: start() starts the workers
        self._setup()
        self._restarts = state["restarts"]
        self._kept_version = state["version"]
        self.workers.recover(state)
        self._pushes.min_version = state["version"]

    def _setup(self) -> None:
        self._gate, self._update_lock = asyncio.Event(), asyncio.Lock()
        self._gate.set()

    async def start(self, model_box: list, detached: bool, timeout_s: float) -> dict:
        await self._up()
        self._setup()
        info = await self.workers.start(model_box, detached, timeout_s)
        if self._keeper is not None:  # what a restarted incarnation starts from
            w = self.workers
            await self._keeper.keep_start.remote(model_box, w.digest, w.canonical, w.spec, w.placements())
            self._kept_version = 0
        return info

    async def _keep(self) -> None:
        """Record an adopted push with the keeper (if any) before the push returns: a pool restarted
        after it serves what the push's caller was told it serves."""
        if self._keeper is None or self.workers.weight_version == self._kept_version:
            return
        version, digest, weights, adapters = self.workers.kept_sources()
        await self._keeper.keep.remote(version, digest, [weights], adapters)
        self._kept_version = max(self._kept_version, version)

    async def _pick(self) -> WorkerSlot | None:
        """The ready worker with the fewest requests in flight; waits while none is ready."""
        cond = self.workers.cond
        async with cond:
            while True:
                if self.workers.closed:
                    return None
                ready = [s for s in self.workers.ready() if s.weight_version >= self._pushes.min_version]
                if ready:
                    return min(ready, key=lambda s: (s.in_flight, s.completed))
                if self.workers.none_can_serve():
                    return None
                await cond.wait()

    # -- requests --------------------------------------------------------------------------------

    async def generate(self, requests: list[tuple[str, list, object]]) -> list:
        await self._up()
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
                    slot.served(rollout)
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
        await self._up()
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
        await self._up()
        digest = await self._pushes.switch(weights_box[0], expected, mode)
        await self._keep()
        return digest

    async def load_adapter(self, name: str, adapter_box: list, expected: str | None, adapter_digest: str) -> str:
        """Every worker to serve the LoRA adapter in `adapter_box[0]` (an ObjectRef of a LoraAdapter) as
        `name`; each checks it before serving it, so a refused adapter changes nothing (coordinator)."""
        await self._up()
        digest = await self._pushes.switch_adapter(name, adapter_box[0], expected, adapter_digest)
        await self._keep()
        return digest

    async def adapters(self) -> dict:
        """name -> the digest of every adapter the workers serve."""
        await self._up()
        return self.workers.current.adapter_digests()

    # bucketed pushes (weight_sync.WeightPush): begin, the sender's buckets, end (weight_sync.coordinator)
    async def begin_weight_sync(self, wire: bytes) -> dict:
        await self._up()
        return await self._pushes.begin(wire)

    async def end_weight_sync(self, sync_id: str, error: str | None = None, digest: str | None = None,
                              declined: bool = False) -> dict:
        await self._up()
        verdict = await self._pushes.end(sync_id, error, digest, declined)
        await self._keep()
        return verdict

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

    async def weights_digest(self) -> str:
        await self._up()
        return self.workers.digest

    # -- status and shutdown ---------------------------------------------------------------------

    async def stats(self) -> dict:
        await self._up()
        workers = self.workers.worker_stats()
        return {**self._counts, "in_flight": self._in_flight, "digest": self.workers.digest,
                "weight_version": self.workers.weight_version, "workers": workers,
                "prefix_cache": prefix_cache_stats.pool_counts(workers),
                "pool_node": ray.get_runtime_context().get_node_id(), "pool_restarts": self._restarts}

    async def sleep(self) -> None:
        """Every serving worker's engine releases its memory (see RolloutWorker.sleep)."""
        await self._up()
        await asyncio.gather(*(s.actor.sleep.remote() for s in self.workers.receivers()))

    async def wake(self) -> None:
        await self._up()
        await asyncio.gather(*(s.actor.wake.remote() for s in self.workers.receivers()))

    async def capabilities(self) -> EngineCapabilities:
        """What every worker's engine can do (EngineCapabilities.common over the workers)."""
        await self._up()
        return EngineCapabilities.common([s.info["capabilities"] for s in self.workers.slots
                                          if "capabilities" in s.info])

    async def worker_handles(self) -> list:
        await self._up()
        return [s.actor for s in self.workers.slots]

    async def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # a recovery that failed: shut down what there is
            await self._up()
        await self.workers.shutdown()
        if self._gate is not None:
            self._gate.set()
        if self._keeper is not None:
            ray.kill(self._keeper)


_PoolActorRemote = ray.remote(_PoolActor)


def start_pool(model, num_workers: int = 2, name: str = "rollout", engine_kwargs: dict | None = None,
               resources_per_worker: dict | None = None, placement_group_bundles: list[dict] | None = None,
               placement_strategy: str = "STRICT_PACK", namespace: str = DEFAULT_NAMESPACE, detached: bool = False,
               max_retries: int = 3, start_timeout_s: float = 120.0, colocate_with=None, pool_node: str | None = None,
               max_restarts: int = 0) -> RolloutClient:
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

    Where the pool's own actor runs: on node `pool_node` (a Ray node id), by default this driver's node,
    pinned there, so that the pool survives the loss of any other node (its workers are restarted on
    live ones). max_restarts (Ray's: -1 = no limit): the pool's own actor is restarted when its process
    dies, recovering the weights (digest, weight version) and the adapters it served from a keeper actor
    on the same node (pool_keeper.py; it holds a copy of each), and RolloutClient calls wait for it
    (RolloutClient.restart_wait_s). Requests in flight are run again, with the same bits; pool counts in
    stats() start again at 0 and "pool_restarts" counts the restarts. It costs an object-store copy of the
    weights served, taken as each push is adopted.

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
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise ValueError(f"max_restarts must be an int >= -1 (-1: no limit), got {max_restarts!r}")
    if isinstance(start_timeout_s, bool) or not isinstance(start_timeout_s, (int, float)) or start_timeout_s <= 0:
        raise ValueError(f"start_timeout_s must be a number > 0, got {start_timeout_s!r}")
    ensure_ray()
    here = NodeAffinitySchedulingStrategy(node_id=_pool_node(pool_node), soft=False)
    options = dict(name=name, namespace=namespace, num_cpus=0, max_concurrency=MAX_CONCURRENCY,
                   scheduling_strategy=here)
    keeper = None
    if max_restarts:
        options["max_restarts"] = max_restarts
        keeper = PoolKeeperRemote.options(num_cpus=0, scheduling_strategy=here, namespace=namespace,
                                          **({"lifetime": "detached"} if detached else {})).remote(
            name, namespace, detached)
    if detached:
        options["lifetime"] = "detached"  # outlives this driver; shut it down explicitly
    try:
        actor = _PoolActorRemote.options(**options).remote(
            num_workers, engine_kwargs, resources_per_worker, placement_group_bundles,
            placement_strategy, max_retries, colocate_with, keeper)
    except ValueError as e:
        if keeper is not None:
            ray.kill(keeper)
        raise ValueError(f"cannot create rollout pool {name!r} in namespace {namespace!r}: {e}") from e
    try:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=start_timeout_s)
        except GetTimeoutError:  # a busy cluster: said in our words, with what the workers would need
            raise TimeoutError(f"the rollout pool's own actor was not ready within {start_timeout_s:g} s, so no "
                               "worker started: " + placement_report(
                                   num_workers, num_workers, placement_group_bundles,
                                   worker_resources(resources_per_worker), start_timeout_s)) from None
        model_box = [model if isinstance(model, (str, os.PathLike)) else ray.put(model)]
        # the pool raises at start_timeout_s; this bound only guards against a pool actor that hangs
        info = ray.get(actor.start.remote(model_box, detached, float(start_timeout_s)), timeout=start_timeout_s + 60)
    except BaseException as e:
        ray.kill(actor)
        if keeper is not None:
            ray.kill(keeper)
        if isinstance(e, RayTaskError):
            raise original_error(e) from e
        raise
    return RolloutClient(name, namespace=namespace, _handle=actor, _info=info)


def _pool_node(node_id: str | None) -> str:
    """The node the pool actor is pinned to: `node_id` (checked to be a live node), else this driver's."""
    if node_id is None:
        return ray.get_runtime_context().get_node_id()
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    if node_id not in alive:
        raise ValueError(f"pool_node {node_id!r} is not a live Ray node; live nodes: {alive}")
    return node_id
