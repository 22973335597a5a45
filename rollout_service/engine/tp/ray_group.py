"""A tensor-parallel group as Ray actors: one rank per bundle of a placement group, torch.distributed
wired among them, the Engine on rank 0 (create_tp_group)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from rollout_service.engine.protocol import EngineCapabilities
from rollout_service.engine.tp.comm import free_port, init_tp_group
from rollout_service.engine.tp.engine import ENGINE_METHODS, TPEngine, TPFollower
from rollout_service.ray_placement import on_bundle, release, reserve


class _TPRank:
    """One rank of a Ray tensor-parallel group (wrapped by ray.remote in create_tp_group)."""

    def free_port(self) -> int:
        return free_port()

    def setup(self, model, rank: int, world_size: int, port: int, engine_kwargs: dict, use_gpu: bool) -> int:
        kwargs = dict(engine_kwargs)
        if use_gpu:
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
            torch.cuda.set_device(0)  # Ray has set CUDA_VISIBLE_DEVICES to this actor's GPU
            kwargs.setdefault("device", "cuda")
        self.ctx = init_tp_group(rank, world_size, port, "nccl" if use_gpu else "gloo")
        if rank == 0:
            self.engine = TPEngine(model, self.ctx, **kwargs)
        else:
            self.follower = TPFollower(model, self.ctx, **kwargs)
        return os.getpid()

    # followers
    def serve(self) -> None:
        self.follower.serve_forever()
        dist.destroy_process_group()

    def stage_weights(self, state_dict) -> None:
        self.follower.stage_weights(state_dict)

    # rank 0
    def call(self, name: str, *args, **kwargs):
        if name not in ENGINE_METHODS:
            raise AttributeError(f"no engine method {name!r} over Ray")
        return getattr(self.engine, name)(*args, **kwargs)

    def shutdown(self) -> None:
        self.engine.close()
        dist.destroy_process_group()


class TPGroup:
    """A tensor-parallel rollout group of Ray actors; rank 0 holds the Engine."""

    def __init__(self, actors, serving, placement, owns_placement: bool):
        self.actors, self._serving = actors, serving
        self.placement, self._owns_placement = placement, owns_placement
        self.leader = actors[0]

    def _call(self, name, *args, **kwargs):
        import ray
        return ray.get(self.leader.call.remote(name, *args, **kwargs))

    def generate(self, prompts, params):
        return self._call("generate", prompts, params)

    def update_weights(self, state_dict, expected_digest: str | None = None) -> str:
        """Full (TP=1) weights to every rank through the object store; returns their digest."""
        import ray
        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(state_dict)
        ray.get([a.stage_weights.remote(ref) for a in self.actors[1:]])
        return self._call("update_weights", ref, followers_staged=True, expected_digest=expected_digest)

    def weights_digest(self) -> str:
        return self._call("weights_digest")

    def engine(self) -> _EngineProxy:
        """An object with the Engine methods a RolloutWorker calls, each a blocking call on rank 0."""
        return _EngineProxy(self)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        import ray

        try:
            ray.get(self.leader.shutdown.remote(), timeout=timeout_s)
            ray.get(self._serving, timeout=timeout_s)
        except ray.exceptions.RayError:  # a rank died or hangs: the kills below end the group anyway
            pass
        for a in self.actors:
            ray.kill(a)
        if self._owns_placement:
            release(self.placement)


class _EngineProxy:
    def __init__(self, group: TPGroup):
        self._group = group

    def capabilities(self) -> EngineCapabilities:
        return TPEngine.CAPABILITIES  # fixed for the class; no round trip to rank 0

    def __getattr__(self, name):
        if name not in ENGINE_METHODS:
            raise AttributeError(name)
        if name == "update_weights":
            return self._group.update_weights
        return lambda *args, **kwargs: self._group._call(name, *args, **kwargs)


def create_tp_group(model, tp_size: int, engine_kwargs: dict | None = None, *, use_gpu: bool = False,
                    placement_group=None, bundle_indices: list[int] | None = None) -> TPGroup:
    """Start `tp_size` rank actors, one per bundle of a placement group ({"CPU": 1} or {"GPU": 1} each,
    STRICT_PACK: one host, since ranks meet at 127.0.0.1), wire torch.distributed among them (gloo on
    CPU, NCCL on GPU) and build the engine on rank 0. `placement_group` + `bundle_indices` place the
    ranks in an existing group instead (e.g. a RolloutWorker's own)."""
    import ray

    owns = placement_group is None
    if owns:
        placement_group = reserve([{"GPU": 1} if use_gpu else {"CPU": 1}] * tp_size, "STRICT_PACK")
        bundle_indices = list(range(tp_size))
    elif bundle_indices is None or len(bundle_indices) != tp_size:
        raise ValueError(f"give {tp_size} bundle_indices of the placement group")
    actors = []
    try:
        ray.get(placement_group.ready())
        rank_cls = ray.remote(_TPRank)
        for i in bundle_indices:
            strategy = on_bundle(placement_group, i)
            actors.append(rank_cls.options(num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0,
                                           max_concurrency=2, scheduling_strategy=strategy).remote())
        port = ray.get(actors[0].free_port.remote())
        model_arg = model if isinstance(model, (str, Path)) else ray.put(model)
        ray.get([a.setup.remote(model_arg, rank, tp_size, port, engine_kwargs or {}, use_gpu)
                 for rank, a in enumerate(actors)])
        serving = [a.serve.remote() for a in actors[1:]]
    except BaseException:
        for a in actors:
            ray.kill(a)
        if owns:
            release(placement_group)
        raise
    return TPGroup(actors, serving, placement_group, owns)
