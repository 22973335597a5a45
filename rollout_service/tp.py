"""Tensor-parallel rollout: rank 0 owns the Engine (scheduler, sampler), every rank runs the forward.

Rank 0 builds `TPEngine(model, ctx, **engine_kwargs)`: an Engine over its rank-local shard whose
runners (verifier and native fast path) are TPModelRunners. Each forward first broadcasts the chunk
batch to the other ranks, which run `TPFollower(model, ctx, **engine_kwargs).serve_forever()`: they
replay the same forward on their shard and their own KV cache (same block ids, local heads only), so
every collective in kernels.tp meets its partner. Logits come back whole (vocab all-gathered).

Canonical forwards use the tree reduction of kernels.tp, so a TP=k rollout equals the TP=1 trainer
bit for bit; the fast path uses a plain all_reduce (it only proposes).

`create_tp_group` starts such a group as Ray actors in a placement group (one bundle per rank).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kernels.forward import CANONICAL_OPS, model_spec
from kernels.tp import shard_model, shard_state_dict, tp_ops, tp_shard_info

from .config import EngineConfig
from .engine import Engine, load_model
from .fast_path.native_ops import FAST_OPS
from .kv_cache import KVCache
from .runner import Chunk, ModelRunner
from .weights import WeightMismatchError, load_weights, model_digest, state_dict_digest

# Op sets a follower can run, by name (the tag rank 0 sends with each batch).
OPS_BY_NAME = {CANONICAL_OPS.name: CANONICAL_OPS, FAST_OPS.name: FAST_OPS}


@dataclasses.dataclass(frozen=True)
class TPContext:
    """A tensor-parallel group: `group` carries tensors (None = the default group), `control_group`
    the pickled batch messages (gloo, so that they never touch the GPU; None = `group`)."""
    group: object = None
    control_group: object = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def leader(self) -> int:
        """Global rank of the group's rank 0 (the sender of every message)."""
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    @property
    def _control(self):
        return self.control_group if self.control_group is not None else self.group

    def send(self, msg) -> None:
        dist.broadcast_object_list([msg], src=self.leader, group=self._control)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self._control)
        return box[0]

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._control)
        return out


def init_tp_group(rank: int, world_size: int, port: int, backend: str = "gloo",
                  addr: str = "127.0.0.1") -> TPContext:
    """Join the default process group (tcp://addr:port) and return its context; with NCCL a gloo
    group is added for the control messages."""
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size)
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    return TPContext(None, control)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPModelRunner:
    """A ModelRunner whose every forward runs on all ranks (rank 0's side; tagged with its op set)."""

    def __init__(self, model, cache: KVCache, ops, device, ctx: TPContext):
        if ops.name not in OPS_BY_NAME:
            raise ValueError(f"op set {ops.name!r} has no follower counterpart (known: {sorted(OPS_BY_NAME)})")
        self.tag, self.ctx = ops.name, ctx
        self.inner = ModelRunner(model, cache, tp_ops(ops, ctx.group, vocab_size=model.config.vocab_size),
                                 device)
        self.model, self.cache, self.ops, self.device = model, cache, self.inner.ops, self.inner.device

    def forward(self, chunks: list[Chunk], token_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        if token_ids is not None:  # followers get host chunks: materialise the fed ids
            chunks = [dataclasses.replace(c, token_ids=[t]) for c, t in zip(chunks, token_ids.tolist())]
        self.ctx.send(("forward", self.tag, chunks))
        return self.inner.forward(chunks)


def _local_model(model, ctx: TPContext, device) -> torch.nn.Module:
    """This rank's shard of `model` (an HF model, a local path, or an already sharded model)."""
    info = tp_shard_info(model) if isinstance(model, torch.nn.Module) else None
    if info is None:
        full = load_model(model, "cpu", copy_model=False) if isinstance(model, (str, Path)) else model
        model = shard_model(full, ctx.rank, ctx.world_size)
    elif (info.rank, info.world_size) != (ctx.rank, ctx.world_size):
        raise ValueError(f"model is shard {info.rank}/{info.world_size}, this is rank {ctx.rank}/{ctx.world_size}")
    return load_model(model, device, copy_model=False)


def _resolve(payload):
    """Weights may arrive as a Ray object reference."""
    ray = sys.modules.get("ray")
    if ray is not None and isinstance(payload, ray.ObjectRef):
        return ray.get(payload)
    return payload


def _load_shard(model, state_dict, ctx: TPContext):
    """None, or the error loading this rank's shard raised (every rank validates the same names)."""
    try:
        load_weights(model, shard_state_dict(state_dict, ctx.rank, ctx.world_size))
        return None
    except Exception as e:  # reported to rank 0, which raises
        return f"rank {ctx.rank}: {type(e).__name__}: {e}"


# what a RolloutWorker calls on its engine; a TP group serves them from rank 0
ENGINE_METHODS = ("generate", "add_request", "abort", "step", "has_unfinished", "update_weights", "weights_digest",
                  "canonical_config")


class TPEngine(Engine):
    """The Engine of rank 0 of a tensor-parallel group (see the module docstring).

    `model` is the full model (object or local path); this rank keeps only its shard. The weights
    digest is the full model's, as the trainer computes it.
    """

    def __init__(self, model, ctx: TPContext | None = None, **engine_kwargs):
        ctx = ctx or TPContext()
        if ctx.rank != 0:
            raise ValueError(f"TPEngine runs on rank 0 of its group; rank {ctx.rank} runs TPFollower")
        fast_path = engine_kwargs.get("fast_path", "native")
        if isinstance(fast_path, str) and fast_path != "native":
            raise ValueError(f"a tensor-parallel engine needs the native fast path, got {fast_path!r}")
        if "runner_factory" in engine_kwargs:
            raise ValueError("TPEngine sets its own runner_factory")
        self.ctx = ctx
        full = load_model(model, "cpu", copy_model=False) if isinstance(model, (str, Path)) else model
        self._digest = model_digest(full)
        device = engine_kwargs.pop("device", EngineConfig.device)
        engine_kwargs.pop("copy_model", None)
        local = _local_model(full, ctx, device)
        super().__init__(local, device=device, copy_model=False, **engine_kwargs,
                         runner_factory=lambda m, cache, ops, dev: TPModelRunner(m, cache, ops, dev, ctx))
        self._closed = False

    def update_weights(self, state_dict, followers_staged: bool = False) -> str:
        """Load full (TP=1) weights on every rank; returns their digest. followers_staged: the followers
        already hold them (TPFollower.stage_weights), so only a notice is broadcast."""
        self.ctx.send(("update_weights", None if followers_staged else state_dict))
        state_dict = _resolve(state_dict)
        errors = [e for e in self.ctx.all_gather_object(_load_shard(self.model, state_dict, self.ctx)) if e]
        if errors:
            raise WeightMismatchError("; ".join(errors))
        self.fast_path.update_weights(state_dict)
        self._digest = state_dict_digest(state_dict)
        return self._digest

    def weights_digest(self) -> str:
        return self._digest

    def close(self) -> None:
        """Release the followers (they return from serve_forever)."""
        if not self._closed:
            self._closed = True
            self.ctx.send(("shutdown",))


class TPFollower:
    """Rank > 0 of a tensor-parallel group: replays rank 0's forwards on this rank's shard.

    Takes the same engine_kwargs as rank 0's TPEngine (device, block_size and kv_cache_tokens size
    the KV cache identically, so rank 0's block ids are valid here).
    """

    def __init__(self, model, ctx: TPContext, **engine_kwargs):
        if ctx.rank == 0:
            raise ValueError("rank 0 runs TPEngine, not TPFollower")
        cfg = EngineConfig.build(**engine_kwargs)  # the leader's cache geometry, from the same options
        self.ctx, self.device = ctx, torch.device(cfg.device)
        self.model = _local_model(model, ctx, self.device)
        self.cache = KVCache(model_spec(self.model), -(-cfg.kv_cache_tokens // cfg.block_size), cfg.block_size,
                             self.device)
        self._runners: dict[str, ModelRunner] = {}
        self._staged = None

    def _runner(self, tag: str) -> ModelRunner:
        if tag not in self._runners:
            ops = tp_ops(OPS_BY_NAME[tag], self.ctx.group, vocab_size=self.model.config.vocab_size)
            self._runners[tag] = ModelRunner(self.model, self.cache, ops, self.device)
        return self._runners[tag]

    def stage_weights(self, state_dict) -> None:
        """Hold weights for the next update_weights notice (rank 0 sent followers_staged=True)."""
        self._staged = state_dict

    def serve_forever(self) -> None:
        """Run rank 0's batches until it sends shutdown."""
        while True:
            msg = self.ctx.recv()
            kind = msg[0]
            if kind == "forward":
                self._runner(msg[1]).forward(msg[2])
            elif kind == "update_weights":
                weights = _resolve(msg[1] if msg[1] is not None else self._staged)
                self._staged = None
                self.ctx.all_gather_object(_load_shard(self.model, weights, self.ctx))
            elif kind == "shutdown":
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel message {kind!r}")


# ---- Ray --------------------------------------------------------------------------------------------

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

    def update_weights(self, state_dict) -> str:
        """Full (TP=1) weights to every rank through the object store; returns their digest."""
        import ray
        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(state_dict)
        ray.get([a.stage_weights.remote(ref) for a in self.actors[1:]])
        return self._call("update_weights", ref, followers_staged=True)

    def weights_digest(self) -> str:
        return self._call("weights_digest")

    def engine(self) -> _EngineProxy:
        """An object with the Engine methods a RolloutWorker calls, each a blocking call on rank 0."""
        return _EngineProxy(self)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        import ray

        from .ray_cluster import release
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
    from .ray_cluster import on_bundle, release, reserve

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


__all__ = ["OPS_BY_NAME", "TPContext", "TPEngine", "TPFollower", "TPGroup", "TPModelRunner", "create_tp_group",
           "free_port", "init_tp_group"]
