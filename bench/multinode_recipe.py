"""The GRPO recipe's step time on one node against three, the same tiny config, workers and ranks; JSON.

    python -m bench.multinode_recipe --steps 6 --rounds 2
    python -m bench.multinode_recipe --steps 2 --rounds 1          # a smoke run

A Ray test cluster on this machine (tests/multinode_shared.py: a head for the driver and nodes a, b and c,
each a raylet of its own with 2 CPUs) runs the recipe in two arms, placed by the nodes' custom resources:
`1 node` puts both rollout workers and both trainer ranks on node a; `3 nodes` puts one worker on a, one on
b (a resource only a and b offer, one unit each) and both ranks on c, so every weight push and every
rollout crosses nodes. Each round runs both arms once, taking turns (the order reversed in odd rounds).
Per arm and round: the nodes its actors reported, the median over the steps after the first of the step's
seconds and its rollout, train and weight-sync parts, and the largest KL and max |Δ log-prob| of any step;
per round the ratio 3-node step / 1-node step. All the nodes share this machine's cores, so the ratio
measures what crossing raylets costs (object store transfers, remote calls), not more hardware.
Progress goes to stderr, the JSON to stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "configs" / "tiny.yaml"
sys.path.insert(0, str(REPO / "tests"))  # the test cluster's helpers (multinode_shared): tests/ is not a package
ROLLOUT_NODE = "zerokl_bench_rollout_node"  # one unit on nodes a and b: one worker each
PHASES = {"step_s": "perf/step_s", "rollout_s": "perf/rollout_s", "train_s": "perf/train_s",
          "weight_sync_s": "perf/weight_sync_s"}


def arm_overrides(arm: str) -> list[str]:
    from multinode_shared import node_resource
    if arm == "1 node":
        worker, rank = {node_resource("a"): 0.25}, {node_resource("a"): 0.25}
    else:
        worker, rank = {ROLLOUT_NODE: 1}, {node_resource("c"): 0.5}
    return [f"rollout.resources_per_worker={{num_cpus: 0.5, resources: {json.dumps(worker)}}}",
            f"trainer.placement.resources_per_rank={{num_cpus: 0.5, resources: {json.dumps(rank)}}}"]


def run_arm(arm: str, steps: int, extra: list[str], run_dir: Path, cluster) -> dict:
    """One run of an arm: its actors' nodes (asked during the first step) and its step figures."""
    from recipes.config import load_config
    from recipes.grpo import GRPOJob
    from multinode_shared import node_of_actor
    overrides = [f"train.steps={steps}", "train.save_every=0", "train.save_final=false", "metrics.wandb=false",
                 f"run_dir={run_dir}", *extra, *arm_overrides(arm)]
    job = GRPOJob(load_config(TINY, overrides))
    records, nodes = [], None
    for record in job.steps(progress=False):
        records.append(record)
        if nodes is None:
            names = {cluster.node_id(n): n for n in ("head", *cluster.nodes)}
            nodes = {"workers": [names[node_of_actor(w)] for w in job.pool.workers()],
                     "ranks": [names[node_of_actor(r)] for r in job.trainer.ranks]}
        print(f"[bench] {arm} step {record['step']}: {record['perf/step_s']:.3f}s", file=sys.stderr, flush=True)
    later = records[1:] or records  # the first step compiles and warms caches
    out = {"nodes": nodes, "distinct_nodes": len(set(nodes["workers"] + nodes["ranks"]))}
    out.update({name: round(statistics.median(r[key] for r in later), 4) for name, key in PHASES.items()})
    out["max_kl"] = max(r["rollout_train/kl"] for r in records)
    out["max_abs_logprob_diff"] = max(r["rollout_train/max_abs_logprob_diff"] for r in records)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is left out of the medians)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per arm, the arms taking turns")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of tiny.yaml, for both arms")
    args = ap.parse_args()

    from multinode_shared import apart_head_args, test_cluster
    arms = ["1 node", "3 nodes"]
    nodes = {name: {"cpus": 2, "resources": {ROLLOUT_NODE: 1} if name in "ab" else {}} for name in "abc"}
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    work = Path(tempfile.mkdtemp(prefix="multinode-bench-"))
    rounds = []
    try:
        with contextlib.redirect_stdout(sys.stderr), test_cluster(
                nodes, head_cpus=1, head_args=apart_head_args(temp_dir)) as c:
            for k in range(args.rounds):
                order = arms if k % 2 == 0 else arms[::-1]
                runs = {arm: run_arm(arm, args.steps, args.overrides, work / f"{k}-{arm.replace(' ', '')}", c)
                        for arm in order}
                ratio = runs["3 nodes"]["step_s"] / runs["1 node"]["step_s"]
                rounds.append({"order": order, **runs, "step_ratio_3_over_1": round(ratio, 3)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
    ratios = [r["step_ratio_3_over_1"] for r in rounds]
    print(json.dumps({"config": "recipes/configs/tiny.yaml", "overrides": args.overrides, "steps": args.steps,
                      "rounds": rounds, "median_step_ratio_3_over_1": statistics.median(ratios)}))


if __name__ == "__main__":
    main()
