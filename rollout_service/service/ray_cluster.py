"""Where the service and the recipes meet Ray's cluster: joining (or starting) Ray, the actor options
that carry the tree width, an actor's GPU ids, why a placement group is still pending, and an actor's
own exception taken out of Ray's wrapper. Placement groups themselves: rollout_service.ray_placement.

Ray is imported inside the functions: `import rollout_service` works without it.
"""
from __future__ import annotations

import os


def init_ray(address: str | None = None) -> bool:
    """Join the cluster of `address` / RAY_ADDRESS (set under `ray job submit`), else a cluster from
    `ray start` on this machine, else start a local one. True when this call started or joined Ray."""
    import ray
    if ray.is_initialized():
        return False
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or "auto")
    else:
        ray.init()
    return True


def with_tree_width(options: dict | None, segments: int) -> dict:
    """Ray actor options that also set the canonical tree width (kernels.contract) in the actor's
    process: runtime_env env_vars, merged with the job's runtime env and inherited by the actors it
    starts."""
    from kernels.contract import TREE_SEGMENTS_ENV
    options = dict(options or {})
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), TREE_SEGMENTS_ENV: str(segments)}
    options["runtime_env"] = runtime_env
    return options


def actor_gpu_ids() -> list[str]:
    """The GPUs Ray gave the calling actor (ray.get_gpu_ids(), as strings): who shares a GPU with whom,
    as Ray placed them; empty for an actor that asked for none, and outside Ray (a rank run in-process
    has no placement to report, and the trainer must not need Ray for that)."""
    try:
        import ray
    except ImportError:
        return []
    if not ray.is_initialized():
        return []
    return [str(g) for g in ray.get_gpu_ids()]


def worker_resources(resources_per_worker: dict | None) -> dict:
    """A rollout worker's Ray actor options: one CPU unless the caller says otherwise."""
    return {"num_cpus": 1, **(resources_per_worker or {})}


def placement_report(pending: int, total: int, bundles: list[dict] | None, resources: dict, timeout_s: float) -> str:
    """Why `pending` of `total` rollout workers, each asking for its placement group's `bundles` or else
    for `resources` (Ray actor options), were not ready in time: what the cluster has free."""
    import ray
    ask = bundles or [{"CPU": resources.get("num_cpus", 1), "GPU": resources.get("num_gpus", 0),
                       **resources.get("resources", {})}]
    free = {k: round(v, 2) for k, v in ray.available_resources().items() if "memory" not in k and "node" not in k}
    whole = {k: round(v, 2) for k, v in ray.cluster_resources().items() if "memory" not in k and "node" not in k}
    return (f"{pending} of {total} rollout workers were not ready within {timeout_s:.0f} s "
            f"(start_pool's start_timeout_s). Each asks for {ask}; the cluster has {free} free of {whole}. "
            f"Free resources, add nodes, or ask for less; a worker that is placed but slow to load "
            f"needs a longer start_timeout_s.")


def original_error(e: BaseException) -> BaseException:
    """A worker's own exception out of Ray's wrapper (RayTaskError.cause), with Ray's error (and the
    remote traceback in it) kept as its __cause__; anything else as it is."""
    from ray.exceptions import RayTaskError
    cause = getattr(e, "cause", None) if isinstance(e, RayTaskError) else None
    if isinstance(cause, BaseException):
        cause.__cause__ = e
        return cause
    return e
