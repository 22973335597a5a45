"""Tensor-parallel rollout: rank 0 owns the Engine (scheduler, sampler), every rank runs the forward.

Rank 0 builds `TPEngine(model, ctx, **engine_kwargs)`: an Engine over its rank-local shard whose
runners (verifier and native fast path) are TPModelRunners. Each forward first broadcasts the chunk
batch to the other ranks, which run `TPFollower(model, ctx, **engine_kwargs).serve_forever()`: they
replay the same forward on their shard and their own KV cache (same block ids, local heads only), so
every collective in kernels.tp meets its partner. Logits come back whole (vocab all-gathered).

Canonical forwards use the tree reduction of kernels.tp, so a TP=k rollout equals the TP=1 trainer
bit for bit; the fast path uses a plain all_reduce (it only proposes).

`create_tp_group` starts such a group as Ray actors in a placement group (one bundle per rank).

Layout: comm.py (process groups and the messages rank 0 sends), engine.py (TPEngine, TPFollower),
ray_group.py (the Ray actors).
"""
from __future__ import annotations

from rollout_service.engine.tp.comm import ForwardBatch, LoadWeights, Shutdown, TPContext, free_port, init_tp_group
from rollout_service.engine.tp.engine import OPS_BY_NAME, TPEngine, TPFollower, TPModelRunner
from rollout_service.engine.tp.ray_group import TPGroup, create_tp_group

__all__ = ["ForwardBatch", "LoadWeights", "OPS_BY_NAME", "Shutdown", "TPContext", "TPEngine", "TPFollower", "TPGroup",
           "TPModelRunner", "create_tp_group", "free_port", "init_tp_group"]
