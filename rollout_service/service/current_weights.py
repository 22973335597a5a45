"""What every worker of a pool must hold (the weights last adopted and the LoRA adapters it serves), and
how a restarted worker comes to hold it again.

Rule: after a push that went worker to worker (weight_sync: broadcast, ipc) the pool keeps no copy of its
tensors (a host copy of every push would cost what those pushes save), so a restarted worker copies a
ready peer's (FROM_PEER), or, when no worker holds them, waits "stale" for the next push (NoCurrentWeights).
"""
from __future__ import annotations

from ray.exceptions import ObjectLostError, RayTaskError

from rollout_service.lora import push_digest
from rollout_service.service.pool_keeper import NO_COPY
from rollout_service.weights import WeightMismatchError

FROM_PEER = "from a ready peer"


class NoCurrentWeights(RuntimeError):
    """No live worker holds the weights (or an adapter) last pushed worker to worker."""


class CurrentWeights:
    """The sources a restarted worker loads from: the weights (None: the ones the pool started with; an
    ObjectRef; FROM_PEER) and, per adapter name, [an ObjectRef of the LoraAdapter or FROM_PEER, the
    adapter's own digest]. Only pushes the pool adopted enter here."""

    def __init__(self):
        self.weights = None
        self._adapters: dict[str, list] = {}

    def adopt_adapter(self, name: str, source, adapter_digest: str) -> None:
        self._adapters[name] = [source, adapter_digest]

    def adapter_digests(self) -> dict[str, str]:
        return {name: held[1] for name, held in self._adapters.items()}

    def sources(self, peer) -> tuple:
        """What a keeper copies (pool_keeper.PoolKeeper.keep): the weights' source (None, an ObjectRef) and
        name -> [[source], digest] per adapter, a ready `peer`'s copy where only the workers hold them (or
        NO_COPY where there is no such peer)."""
        def held(source, copy):
            if source is not FROM_PEER:
                return source
            return NO_COPY if peer is None else copy()
        weights = held(self.weights, lambda: peer.state_dict.remote())
        adapters = {name: [[held(source, lambda n=name: peer.adapter.remote(n))], digest]
                    for name, (source, digest) in self._adapters.items()}
        return weights, adapters

    def restore(self, weights, adapters: dict[str, list]) -> None:
        """The sources a keeper held (a restarted pool): NO_COPY is a source only the workers held."""
        def source_of(kept):
            return FROM_PEER if isinstance(kept, str) and kept == NO_COPY else kept
        self.weights = source_of(weights)
        self._adapters = {name: [source_of(source), digest] for name, (source, digest) in adapters.items()}

    async def load_into(self, actor, index: int, digest: str, version: int, peers: list) -> str:
        """Load everything into a restarted worker (`actor`, slot `index`), stamped `version`: the weights of
        `digest`, then every adapter. peers: ready workers to copy from where no object holds them (copied
        once, into an object this pool owns, for later restarts). Returns the digest of the weights loaded."""
        def peer(what: str):
            if not peers:
                raise NoCurrentWeights(f"no live worker holds the current {what} (and their sender's copy is gone)")
            return peers[0]
        loaded = await self._load_weights(actor, digest, version, peer)
        for name, held in list(self._adapters.items()):
            if held[0] is FROM_PEER:
                held[0] = peer(f"adapter {name!r}").adapter.remote(name)
            got = await actor.load_adapter.remote(name, held[0], None, version)
            if got != push_digest(held[1], loaded):
                raise WeightMismatchError(f"restarted worker {index} serves adapter {name!r} with digest {got}, "
                                          f"expected {push_digest(held[1], loaded)}")
        return loaded

    async def _load_weights(self, actor, digest: str, version: int, peer) -> str:
        if self.weights is None:
            return await actor.weights_digest.remote()
        if self.weights is not FROM_PEER:
            try:
                return await actor.update_weights.remote(self.weights, digest, version)
            except (ObjectLostError, RayTaskError) as e:
                if not isinstance(getattr(e, "cause", e), ObjectLostError):
                    raise
        # Pushed worker to worker, or their sender (the object's owner) is gone: copy them from a
        # ready worker, into an object this actor owns.
        self.weights = peer("weights").state_dict.remote()
        return await actor.update_weights.remote(self.weights, digest, version)
