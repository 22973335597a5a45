"""Where a GRPO job's actors go: the bundles of its placement group (rollout workers and trainer ranks,
apart or sharing a GPU) and the trainer ranks' first bundle."""
from __future__ import annotations

import ray

from rollout_service.ray_placement import reserve

from .config import RecipeConfig


def ranks_first_bundle(cfg: RecipeConfig) -> int:
    """The trainer ranks' first bundle of a job's placement group: colocated, worker i's (bundle i); split,
    the one after the workers' (placement_bundles)."""
    return 0 if cfg.placement == "colocated" else cfg.rollout.num_workers


def placement_bundles(cfg: RecipeConfig) -> list[dict]:
    """The bundles of a job's placement group, in order. Colocated: one per trainer rank, holding rollout
    worker i and rank i: both actors' CPUs and the GPU (on GPU runs) that they share. Split: one per
    rollout worker, then one per rank, each holding its actor's resources, so that a worker's GPU is
    never a rank's (Ray packs fractional GPU shares onto one GPU when no bundle keeps them apart)."""
    w, t = cfg.rollout.resources_per_worker, cfg.trainer.placement.resources_per_rank

    def bundle(cpus: float, gpus: float) -> dict:
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    if cfg.placement == "split":
        rank_gpus = t.get("num_gpus", 1 if cfg.trainer.device == "cuda" else 0)
        return ([bundle(w.get("num_cpus", 1), w.get("num_gpus", 0))] * cfg.rollout.num_workers
                + [bundle(t.get("num_cpus", 1), rank_gpus)] * cfg.trainer.num_ranks)
    gpus = w.get("num_gpus", 0) + t.get("num_gpus", 0)
    if cfg.trainer.device == "cuda" and not 0 < t.get("num_gpus", 0) < 1:
        raise ValueError("placement: colocated on GPUs needs trainer.placement.resources_per_rank.num_gpus, a share "
                         "below 1 (the rollout worker takes the rest)")
    if gpus > 1:
        raise ValueError(f"placement: colocated shares one GPU per bundle: the worker's and the rank's num_gpus "
                         f"add up to {gpus} > 1")
    return [bundle(w.get("num_cpus", 1) + t.get("num_cpus", 1), gpus)] * cfg.trainer.num_ranks


def reserve_placement(cfg: RecipeConfig):
    """A placement group of placement_bundles(cfg) (cfg.trainer.placement.strategy), once it is ready."""
    group = reserve(placement_bundles(cfg), cfg.trainer.placement.strategy)
    ray.get(group.ready())
    return group
