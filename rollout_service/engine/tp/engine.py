"""Rank 0's Engine and the other ranks' followers of a tensor-parallel group (see rollout_service.engine.tp)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from kernels.forward import CANONICAL_OPS, model_spec
from kernels.tp import shard_model, shard_state_dict, tp_ops, tp_shard_info
from rollout_service.engine.config import EngineConfig
from rollout_service.engine.engine import Engine, load_model
from rollout_service.engine.fast_path.native_ops import FAST_OPS
from rollout_service.engine.kv_cache import KVCache
from rollout_service.engine.protocol import EngineCapabilities
from rollout_service.engine.runner import Chunk, ModelRunner
from rollout_service.engine.tp.comm import ForwardBatch, LoadWeights, Shutdown, TPContext
from rollout_service.weight_digest import model_digest, state_dict_digest
from rollout_service.weights import WeightMismatchError, load_weights

# Op sets a follower can run, by name (rank 0 names its op set in each ForwardBatch).
OPS_BY_NAME = {CANONICAL_OPS.name: CANONICAL_OPS, FAST_OPS.name: FAST_OPS}


class TPModelRunner:
    """A ModelRunner whose every forward runs on all ranks (rank 0's side; tagged with its op set)."""

    def __init__(self, model, cache: KVCache, ops, device, ctx: TPContext):
        if ops.name not in OPS_BY_NAME:
            raise ValueError(f"op set {ops.name!r} has no follower counterpart (known: {sorted(OPS_BY_NAME)})")
        self.tag, self.ctx = ops.name, ctx
        self.inner = ModelRunner(model, cache, tp_ops(ops, ctx.group, vocab_size=model.config.vocab_size),
                                 device)
        self.model, self.cache, self.ops, self.device = model, cache, self.inner.ops, self.inner.device

    def forward(self, chunks: list[Chunk], token_ids: torch.Tensor | None = None,
                routing: list | None = None) -> list[torch.Tensor]:
        if routing is not None:
            raise NotImplementedError("recording MoE routing (return_routed_experts) is not supported under "
                                      "tensor parallelism")
        if token_ids is not None:  # followers get host chunks: materialise the fed ids
            chunks = [dataclasses.replace(c, token_ids=[t]) for c, t in zip(chunks, token_ids.tolist())]
        self.ctx.send(ForwardBatch(self.tag, chunks))
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


# what a RolloutWorker calls on its engine (engine.protocol.RolloutEngine); a TP group serves them from rank 0
ENGINE_METHODS = ("generate", "add_request", "abort", "step", "has_unfinished", "update_weights", "weights_digest",
                  "canonical_config", "sleep", "wake_weights", "wake")


class TPEngine(Engine):
    """The Engine of rank 0 of a tensor-parallel group (see the module docstring).

    `model` is the full model (object or local path); this rank keeps only its shard. The weights
    digest is the full model's, as the trainer computes it.
    """

    # its update_weights keeps the running requests' KV, so weights change only with none running;
    # they arrive whole (a bucketed push would load full tensors into shards); the TP runner records
    # no MoE routing; sleep releases nothing, as the native Engine's
    CAPABILITIES = EngineCapabilities(switch_modes=False, routing_records=False, bucketed_push=False, sleep=False)

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

    def update_weights(self, state_dict, followers_staged: bool = False, expected_digest: str | None = None) -> str:
        """Load full (TP=1) weights on every rank; returns their digest. followers_staged: the followers
        already hold them (TPFollower.stage_weights), so only a notice is broadcast. A digest other than
        `expected_digest` is refused before any rank loads anything."""
        if expected_digest is not None:
            digest = state_dict_digest(_resolve(state_dict))
            if digest != expected_digest:
                raise WeightMismatchError(f"the weights' digest is {digest}, expected {expected_digest}")
        self.ctx.send(LoadWeights(None if followers_staged else state_dict))
        state_dict = _resolve(state_dict)
        errors = [e for e in self.ctx.all_gather_object(_load_shard(self.model, state_dict, self.ctx)) if e]
        if errors:
            raise WeightMismatchError("; ".join(errors))
        self.fast_path.update_weights(state_dict)
        self._digest = state_dict_digest(state_dict)
        return self._digest

    def capabilities(self) -> EngineCapabilities:
        return self.CAPABILITIES

    def weights_digest(self) -> str:
        return self._digest

    def close(self) -> None:
        """Release the followers (they return from serve_forever)."""
        if not self._closed:
            self._closed = True
            self.ctx.send(Shutdown())


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
            if isinstance(msg, ForwardBatch):
                self._runner(msg.ops).forward(msg.chunks)
            elif isinstance(msg, LoadWeights):
                weights = _resolve(msg.state_dict if msg.state_dict is not None else self._staged)
                self._staged = None
                self.ctx.all_gather_object(_load_shard(self.model, weights, self.ctx))
            elif isinstance(msg, Shutdown):
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel message {msg!r}")
