"""Where a GRPO job's actors go: the bundles of its placement groups (rollout workers and trainer ranks,
apart or sharing a GPU), each bundle's node, and the groups a job reserves for itself.

Rule: a bundle carries every resource its actor asks for, custom ones included (`resources`, e.g. a
node's own resource, and `memory`), so that a config's placement by node or by resource holds inside
placement groups as it does for a plain actor."""
from __future__ import annotations

import dataclasses

import ray

from rollout_service.ray_placement import release, reserve

from .config import ConfigError, RecipeConfig

# how long a job waits for its placement groups before it refuses to start (the cluster cannot hold them)
PLACEMENT_TIMEOUT_S = 60.0


def ranks_first_bundle(cfg: RecipeConfig) -> int:
    """The trainer ranks' first bundle of a caller's whole-job placement group (reserve_placement):
    colocated, worker i's (bundle i); split, the one after the workers' (placement_bundles)."""
    return 0 if cfg.placement == "colocated" else cfg.rollout.num_workers


def _bundle(options: dict, cpus_default: float = 1, gpus: float | None = None) -> dict:
    """One actor's bundle from its Ray actor options: CPUs, GPUs, memory and custom resources."""
    gpus = options.get("num_gpus", 0) if gpus is None else gpus
    bundle = {"CPU": options.get("num_cpus", cpus_default), **({"GPU": gpus} if gpus else {})}
    if options.get("memory"):
        bundle["memory"] = options["memory"]
    bundle.update(options.get("resources") or {})
    return bundle


def _merged(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def worker_bundles(cfg: RecipeConfig) -> list[dict]:
    """A bundle per rollout worker (split placement), holding its actor's resources."""
    return [_bundle(cfg.rollout.resources_per_worker)] * cfg.rollout.num_workers


def rank_bundles(cfg: RecipeConfig) -> list[dict]:
    """A bundle per trainer rank (split placement), holding its actor's resources; a GPU rank's GPU."""
    t = cfg.trainer.placement.resources_per_rank
    return [_bundle(t, gpus=t.get("num_gpus", 1 if cfg.trainer.device == "cuda" else 0))] * cfg.trainer.num_ranks


def placement_bundles(cfg: RecipeConfig) -> list[dict]:
    """The bundles of a whole job's placement group, in order. Colocated: one per trainer rank, holding
    rollout worker i and rank i: both actors' resources and the GPU (on GPU runs) that they share. Split:
    one per rollout worker, then one per rank, each holding its actor's resources, so that a worker's GPU
    is never a rank's (Ray packs fractional GPU shares onto one GPU when no bundle keeps them apart)."""
    if cfg.placement == "split":
        return worker_bundles(cfg) + rank_bundles(cfg)
    w, t = cfg.rollout.resources_per_worker, cfg.trainer.placement.resources_per_rank
    gpus = w.get("num_gpus", 0) + t.get("num_gpus", 0)
    if cfg.trainer.device == "cuda" and not 0 < t.get("num_gpus", 0) < 1:
        raise ValueError("placement: colocated on GPUs needs trainer.placement.resources_per_rank.num_gpus, a share "
                         "below 1 (the rollout worker takes the rest)")
    if gpus > 1:
        raise ValueError(f"placement: colocated shares one GPU per bundle: the worker's and the rank's num_gpus "
                         f"add up to {gpus} > 1")
    return [_merged(_bundle(w, gpus=0), _bundle(t, gpus=gpus))] * cfg.trainer.num_ranks


def _ready(group, bundles: list[dict], strategy: str, what: str, timeout_s: float):
    """`group` once Ray has placed it; a ConfigError naming its bundles and the cluster's free resources
    when it is not placed within timeout_s (the group is released: nothing is left reserved)."""
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        release(group)
        free = {k: round(v, 2) for k, v in ray.available_resources().items() if "memory" not in k
                and not k.startswith("node:")}
        raise ConfigError(f"{what}: Ray could not place the bundles {bundles} ({strategy}) within {timeout_s:.0f} s; "
                          f"the cluster has {free} free. A custom resource no node offers, more than one node "
                          f"holds, or a STRICT strategy the nodes cannot meet never places") from None
    return group


def reserve_placement(cfg: RecipeConfig, timeout_s: float = PLACEMENT_TIMEOUT_S):
    """A placement group of placement_bundles(cfg) (cfg.trainer.placement.strategy), once it is ready."""
    bundles, strategy = placement_bundles(cfg), cfg.trainer.placement.strategy
    return _ready(reserve(bundles, strategy), bundles, strategy, "placement", timeout_s)


@dataclasses.dataclass
class JobPlacement:
    """The placement groups a job's actors take. workers: worker i on bundle i (None: each worker an actor
    placed by Ray from rollout.resources_per_worker); ranks: rank r on bundle first_rank_bundle + r.
    owned: the groups the job reserved itself, released by release()."""
    workers: object | None
    ranks: object
    first_rank_bundle: int
    owned: list

    def rank_nodes(self) -> list[str]:
        """The node id of each rank's bundle, in rank order."""
        nodes = bundle_nodes(self.ranks)
        return [nodes[self.first_rank_bundle + r] for r in range(len(nodes) - self.first_rank_bundle)]

    def release(self) -> None:
        for group in self.owned:
            release(group)
        self.owned = []


def bundle_nodes(group) -> list[str]:
    """The node id of each bundle of a ready placement group, in bundle order."""
    table = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return [table[i] for i in range(len(table))]


def reserve_job_placement(cfg: RecipeConfig, caller_group=None, timeout_s: float = PLACEMENT_TIMEOUT_S) -> JobPlacement:
    """A job's placement groups. A caller's whole-job group (reserve_placement) is taken as it is. Colocated:
    one group of placement_bundles (trainer.placement.strategy). Split: the ranks' group (rank_bundles,
    trainer.placement.strategy) and, when rollout.placement_strategy is set, the workers' (worker_bundles,
    that strategy). A group Ray cannot place in timeout_s is a ConfigError; none is left reserved then."""
    if caller_group is not None:
        return JobPlacement(caller_group, caller_group, ranks_first_bundle(cfg), [])
    if cfg.placement == "colocated":
        group = reserve_placement(cfg, timeout_s)
        return JobPlacement(group, group, 0, [group])
    owned = []
    try:
        ranks = _ready(reserve(rank_bundles(cfg), cfg.trainer.placement.strategy), rank_bundles(cfg),
                       cfg.trainer.placement.strategy, "trainer.placement", timeout_s)
        owned.append(ranks)
        workers = None
        if cfg.rollout.placement_strategy is not None:
            workers = _ready(reserve(worker_bundles(cfg), cfg.rollout.placement_strategy), worker_bundles(cfg),
                             cfg.rollout.placement_strategy, "rollout.placement_strategy", timeout_s)
            owned.append(workers)
    except BaseException:
        for group in owned:
            release(group)
        raise
    return JobPlacement(workers, ranks, 0, owned)
