"""Where the service and the recipes meet Ray's cluster: joining (or starting) Ray (an address that cannot
be reached is said at once), the actor options that carry the tree width, an actor's GPU ids, why a
placement group is still pending, and an actor's own exception taken out of Ray's wrapper. Placement
groups themselves: rollout_service.ray_placement.

Ray is imported inside the functions: `import rollout_service` works without it.
"""
from __future__ import annotations

import os
import socket

# How long init_ray waits for a TCP connection to a cluster's address before saying it cannot be reached.
PROBE_TIMEOUT_S = 5.0
GCS_DEFAULT_PORT = 6379  # `ray start --head`'s default GCS port


def init_ray(address: str | None = None, probe_timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Join the cluster of `address` / RAY_ADDRESS (set under `ray job submit`), else a cluster from
    `ray start` on this machine, else start a local one. True when this call started or joined Ray.

    An address given (host:port, or ray://host:port) is probed first: one that takes no TCP connection
    within probe_timeout_s raises ConnectionError naming it, where ray.init would wait far longer."""
    import ray
    if ray.is_initialized():
        return False
    env = os.environ.get("RAY_ADDRESS")
    given = env or address  # ray.init takes RAY_ADDRESS over its argument, so it is the one probed
    if given:
        probe_address(given, probe_timeout_s, "RAY_ADDRESS" if env else "address")
        ray.init(address=given)
    else:
        ray.init()
    return True


def probe_address(address: str, timeout_s: float = PROBE_TIMEOUT_S, what: str = "address") -> None:
    """Raise ConnectionError, naming `address`, unless its host:port takes a TCP connection within
    timeout_s. "auto" and "local" (found or started on this machine) are not probed."""
    if address in ("auto", "local"):
        return
    host, port = _host_port(address)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:  # refused, unreachable, unknown host, timed out
        raise ConnectionError(
            f"cannot reach the Ray cluster at {address!r} (the {what}; {host}:{port} took no TCP connection "
            f"within {timeout_s:g} s: {e}). Is its head node running (`ray start --head`), and is that port "
            f"(the GCS port, or the Ray client port for ray://) open from this machine?") from None


def _host_port(address: str) -> tuple[str, int]:
    """host and port of a Ray address: host:port, ray://host:port (a Ray client), or a bare host."""
    rest = address.split("://", 1)[1] if "://" in address else address
    rest = rest.split("/", 1)[0]
    if rest.startswith("["):  # [ipv6]:port
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if not port:
        return host, 10001 if address.startswith("ray://") else GCS_DEFAULT_PORT
    try:
        return host, int(port)
    except ValueError:
        raise ConnectionError(f"cannot reach the Ray cluster at {address!r}: {port!r} is not a port") from None


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
    free = _shown(ray.available_resources())
    whole = _shown(ray.cluster_resources())
    return (f"{pending} of {total} rollout workers were not ready within {timeout_s:.0f} s "
            f"(start_pool's start_timeout_s). Each asks for {ask}; the cluster has {free} free of {whole}"
            f"{_no_node_fits(ask)}. Free resources, add nodes, or ask for less; a worker that is placed but "
            f"slow to load needs a longer start_timeout_s.")


def _shown(resources: dict) -> dict:
    """Resources as a report shows them: without memory and Ray's own per-node "node:<ip>" entries."""
    return {k: round(v, 2) for k, v in resources.items() if "memory" not in k and not k.startswith("node:")}


def _no_node_fits(ask: list[dict]) -> str:
    """", but no node offers ..." for a bundle that no live node could hold even when idle (a resource
    no node has, or more of one than any node has): waiting longer would not help."""
    import ray
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for bundle in ask:
        want = {k: v for k, v in bundle.items() if v}
        if not any(all(node.get(k, 0) >= v for k, v in want.items()) for node in nodes):
            missing = sorted(k for k in want if not any(k in node for node in nodes))
            what = f"{missing} at all" if missing else f"all of {want} at once"
            return f", but none of its {len(nodes)} live nodes offers {what}"
    return ""


def original_error(e: BaseException) -> BaseException:
    """A worker's own exception out of Ray's wrapper (RayTaskError.cause), with Ray's error (and the
    remote traceback in it) kept as its __cause__; anything else as it is."""
    from ray.exceptions import RayTaskError
    cause = getattr(e, "cause", None) if isinstance(e, RayTaskError) else None
    if isinstance(cause, BaseException):
        cause.__cause__ = e
        return cause
    return e
