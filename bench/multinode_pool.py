"""One rollout pool over several Ray nodes against the same number of workers on one node, and how long a
pool takes to be back at full capacity after losing a node. Nodes are simulated: Ray's multi-node test
cluster (ray.cluster_utils.Cluster) on this machine, each node a raylet of its own (so they share its cores).

    python -m bench.multinode_pool --workers 3 --nodes 3 --requests 300 --rounds 2

Both pools run side by side in one cluster (the driver's node holds the pool actors, no worker): "one node"
has all the workers on one node, "spread" one worker a node over --nodes nodes (tiny:qwen2 workers, the
load of bench/service_load.py: one generate_async a request from several client threads). Their load runs
alternate, round by round. Then two spare nodes are added and the node of one spread worker is removed,
once idle and once under load: the time until the pool notices and until every worker is ready again (full
capacity), and the load's lost / duplicated requests. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from bench.service_load import run_load
from rollout_service.tiny_models import tiny_model

ONE, SPREAD = "one_node", "spread"


def _node_of(actor) -> str:
    import ray
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def _all_ready(client) -> bool:
    return all(w["state"] == "ready" for w in client.stats()["workers"])


def _until(cond, timeout_s: float) -> float:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"not back within {timeout_s} s")
        time.sleep(0.05)
    return time.perf_counter() - t0


def node_loss(cluster, nodes: dict, client, under_load: int = 0, timeout_s: float = 300.0) -> dict:
    """Remove the node of the pool's worker 0 (`under_load` requests running meanwhile): seconds from the
    loss (remove_node called) until the pool takes the worker out of rotation (detected_s) and until
    every worker is ready again (recovery_s: full capacity), where the worker came back, and the load's
    counts (lost / duplicated requests)."""
    by_id = {n.node_id: name for name, n in nodes.items()}
    victim = by_id[_node_of(client.workers()[0])]
    load = {}
    thread = None
    if under_load:
        thread = threading.Thread(target=lambda: load.update(run_load(client, under_load, 2, (16, 32))))
        thread.start()
        _until(lambda: client.stats()["workers"][0]["in_flight"] > 0, 60)
    t0 = time.perf_counter()
    cluster.remove_node(nodes.pop(victim), allow_graceful=False)
    _until(lambda: client.stats()["workers"][0]["state"] != "ready", 60)
    detected = time.perf_counter() - t0
    _until(lambda: _all_ready(client), timeout_s)
    recovery = time.perf_counter() - t0
    if thread is not None:
        thread.join()
    out = {"lost_node": victim, "worker_back_on": by_id.get(_node_of(client.workers()[0])),
           "detected_s": round(detected, 2), "recovery_s": round(recovery, 2)}
    if under_load:
        out.update({k: load[k] for k in ("requests", "completed", "errors", "lost", "duplicated", "worker_executions")})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3, help="nodes the spread pool's workers run on")
    ap.add_argument("--requests", type=int, default=300, help="requests per load run")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="load runs per pool, in turns")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--loss-requests", type=int, default=64, help="requests running while a node is lost")
    args = ap.parse_args(argv)
    if args.workers % args.nodes:
        ap.error("--workers must be a multiple of --nodes (the same number of workers on each node)")

    import ray
    from ray.cluster_utils import Cluster

    from rollout_service import start_pool

    per_node = args.workers // args.nodes
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = {ONE: cluster.add_node(num_cpus=args.workers, resources={ONE: args.workers})}
    for i in range(args.nodes):
        nodes[f"spread{i}"] = cluster.add_node(num_cpus=per_node, resources={SPREAD: per_node})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    model = tiny_model("qwen2")
    engine = dict(window=4, group=16)
    pools = {}
    try:
        for kind in (ONE, SPREAD):
            pools[kind] = start_pool(model, num_workers=args.workers, name=f"bench-{kind}", engine_kwargs=engine,
                                     resources_per_worker={"num_cpus": 1, "resources": {kind: 1}}, start_timeout_s=300)
        by_id = {n.node_id: name for name, n in nodes.items()}
        placed = {kind: sorted(by_id[_node_of(w)] for w in pool.workers()) for kind, pool in pools.items()}
        runs = {kind: [] for kind in pools}
        for _ in range(args.rounds):
            for kind, pool in pools.items():
                runs[kind].append(run_load(pool, args.requests, args.threads, (args.min_tokens, args.max_tokens)))
        rps = {kind: statistics.median(r["throughput_req_s"] for r in rs) for kind, rs in runs.items()}
        nodes.pop(ONE)
        for i in range(2):  # spares, where the workers of the two lost nodes come back
            nodes[f"spare{i}"] = cluster.add_node(num_cpus=per_node, resources={SPREAD: per_node})
        cluster.wait_for_nodes()
        idle_loss = node_loss(cluster, nodes, pools[SPREAD])
        loaded_loss = node_loss(cluster, nodes, pools[SPREAD], under_load=args.loss_requests)
        report = {
            "workers": args.workers, "spread_nodes": args.nodes, "requests_per_run": args.requests,
            "client_threads": args.threads, "rounds": args.rounds, "max_tokens": [args.min_tokens, args.max_tokens],
            "placement": placed,
            "req_s": {kind: [r["throughput_req_s"] for r in rs] for kind, rs in runs.items()},
            "median_req_s": rps, "spread_over_one_node": round(rps[SPREAD] / rps[ONE], 3),
            "lost": sum(r["lost"] for rs in runs.values() for r in rs),
            "duplicated": sum(r["duplicated"] for rs in runs.values() for r in rs),
            "node_loss_idle": idle_loss, "node_loss_under_load": loaded_loss,
        }
    finally:
        for pool in pools.values():
            pool.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
