"""The run directory must be one directory on every node: the check a job makes before anything long starts.

Rule: each trainer rank writes its checkpoint shards into the run directory on its own node, and a resumed
run may place its ranks on other nodes; so the directory must be shared storage (a network filesystem
mounted at the same path on every node), which the driver proves at the start: it writes a probe file there,
one Ray task on each rank's bundle, in the rank's runtime env, must read it and write one of its own, and
the driver must read that back. A node that fails either way is a ConfigError naming the path and the node.
"""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import ray

from rollout_service.ray_placement import on_bundle

from .config import ConfigError

PROBE_DIR = ".node_probes"  # under the run directory; removed once the check passes
PROBE_TIMEOUT_S = 120.0  # a probe task's worker starts in the rank's runtime env (a first start installs it)


def _probe_on_node(run_dir: str, token: str, rank: int) -> dict:
    """On a rank's node: whether the driver's probe file is there with its token; then this node's own."""
    import socket

    probes = Path(run_dir) / PROBE_DIR
    node = ray.get_runtime_context().get_node_id()
    try:
        seen = (probes / f"driver-{token}").read_text() == token
    except OSError:
        seen = False
    wrote = None
    if seen:
        try:
            (probes / f"rank{rank}-{token}").write_text(node)
        except OSError as e:
            wrote = f"{type(e).__name__}: {e}"
    return {"node": node, "host": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "seen": seen,
            "write_error": wrote}


def check_shared_run_dir(run_dir: Path, rank_group, first_bundle: int, num_ranks: int, runtime_env: dict | None,
                         timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """The probe round trip for every rank (on bundle first_bundle + r of rank_group, in the ranks'
    runtime_env); the node id of each rank. Raises ConfigError naming the run directory and the first node
    that does not share it, or that gives no answer within timeout_s."""
    token = uuid.uuid4().hex
    probes = run_dir / PROBE_DIR
    probes.mkdir(parents=True, exist_ok=True)
    (probes / f"driver-{token}").write_text(token)
    task = ray.remote(_probe_on_node)
    refs = [task.options(num_cpus=0, runtime_env=runtime_env,
                         scheduling_strategy=on_bundle(rank_group, first_bundle + r)).remote(str(run_dir), token, r)
            for r in range(num_ranks)]
    rule = ("every trainer rank writes its checkpoint shards there, and a resumed run reads them on whichever "
            "nodes its ranks get: set output_dir (or run_dir) to a directory that every node mounts at the same "
            "path (a network filesystem)")
    try:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            for ref in pending:
                ray.cancel(ref, force=True)
            late = [r for r, ref in enumerate(refs) if ref in pending]
            raise ConfigError(f"run directory {run_dir}: trainer rank {late[0]}'s node gave no answer to the "
                              f"storage probe within {timeout_s:.0f} s; {rule}")
        nodes = []
        for r, answer in enumerate(ray.get(refs)):
            where = f"trainer rank {r} on node {answer['node']} ({answer['host']}, {answer['ip']})"
            if not answer["seen"]:
                raise ConfigError(f"run directory {run_dir}: {where} does not see the driver's probe file "
                                  f"{probes / ('driver-' + token)} there; {rule}")
            if answer["write_error"] is not None:
                raise ConfigError(f"run directory {run_dir}: {where} cannot write there "
                                  f"({answer['write_error']}); {rule}")
            if not (probes / f"rank{r}-{token}").is_file():
                raise ConfigError(f"run directory {run_dir}: the driver does not see the probe file that {where} "
                                  f"wrote there; {rule}")
            nodes.append(answer["node"])
    finally:
        shutil.rmtree(probes, ignore_errors=True)
    return nodes
