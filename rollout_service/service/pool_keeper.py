"""What a restartable pool (start_pool(max_restarts=...)) needs to come back as it was: a small actor, the
keeper, that outlives the pool actor's process and owns copies of the objects the pool serves from.

Rule: Ray frees an object with its owner, and the pool actor owns nothing that outlives it (its workers die
with it too: an actor's children share its fate). So the keeper holds, and owns in its own object store (on
its node, the driver's, as the pool's), the model the workers start from (where it is an object), the
weights last adopted and every adapter, with their digests and the weight version, and each worker's placement
group (which outlives the actor that reserved it, so a restarted pool reuses it). The pool records them
after every adopted push, before the push returns; a restarted pool reads them back (PoolKeeper.incarnation)
and restarts its workers with them, as a dead worker is restarted (supervisor.WorkerSupervisor.recover).
Copies cost object-store memory on the keeper's node (one copy of the weights and adapters served, and of
the model where it was passed as an object); a pool without restarts has no keeper.
"""
from __future__ import annotations

import asyncio

import ray

# A recorded source that no object holds (a push that went worker to worker, with no ready worker to copy
# from when it was recorded): a restarted pool's workers wait for the next push, as after a worker restart.
NO_COPY = "no copy"

KEEPER_WATCH_S = 5.0  # how often a detached keeper checks that its pool still exists


class PoolKeeper:
    """Owns what a restarted pool loads again; see the module doc."""

    def __init__(self, pool_name: str, namespace: str, detached: bool):
        self._pool = (pool_name, namespace)
        self._detached = detached
        self._state: dict | None = None  # None until the pool's first start has been recorded
        self._copies: dict[str, object] = {}  # what a copy holds ("weights <digest>", ...) -> this keeper's copy
        self.restarts = 0

    async def _own(self, key: str, box: list):
        """This keeper's copy of the object in box[0] (a path or NO_COPY as it is), held as `key` (what it
        is: the same key, the same content): fetched and put here once."""
        source = box[0]
        if key not in self._copies and isinstance(source, ray.ObjectRef):
            self._copies[key] = ray.put(await source)
        return self._copies.get(key, source)

    async def keep_start(self, model_box: list, digest: str, canonical, spec, placements: list) -> None:
        """The pool started: what its workers start from, the weights they loaded (version 0) and each
        worker's placement group (or None)."""
        self._state = {"model": await self._own("model", model_box), "digest": digest, "canonical": canonical,
                       "spec": spec, "version": 0, "weights": None, "adapters": {}, "placements": placements}
        if self._detached:
            asyncio.get_running_loop().create_task(self._watch())

    async def keep(self, version: int, digest: str, weights_box: list, adapters: dict[str, list]) -> None:
        """An adopted push: the weights of `digest` (weights_box: [None for the start weights, an ObjectRef,
        or NO_COPY]) and every adapter (name -> [[source], adapter digest]) as of weight `version`."""
        if self._state is None or version <= self._state["version"]:
            return  # a later version is kept already (records may arrive out of order)
        keys = {"weights": f"weights {digest}", **{name: f"adapter {name} {d}" for name, (_, d) in adapters.items()}}
        weights = None if weights_box[0] is None else await self._own(keys["weights"], weights_box)
        held = {name: [await self._own(keys[name], box), d] for name, (box, d) in adapters.items()}
        if version <= self._state["version"]:
            return
        self._state.update(version=version, digest=digest, weights=weights, adapters=held)
        live = {"model", *keys.values()}
        self._copies = {k: copy for k, copy in self._copies.items() if k in live}

    async def incarnation(self) -> dict | None:
        """None before the pool's first start is recorded (a new pool); else the state to recover, for a
        pool actor that was restarted (each call is one more restart)."""
        if self._state is None:
            return None
        self.restarts += 1
        return {**self._state, "restarts": self.restarts}

    async def _watch(self) -> None:
        """A detached keeper leaves once its pool is gone for good (killed without shutdown())."""
        name, namespace = self._pool
        while True:
            await asyncio.sleep(KEEPER_WATCH_S)
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                ray.kill(ray.get_runtime_context().current_actor)
                return


PoolKeeperRemote = ray.remote(PoolKeeper)
