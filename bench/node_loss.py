"""The step time of a GRPO step that loses a rollout node while its rollouts are in flight, against undisturbed
steps; prints JSON.

    python -m bench.node_loss --steps 6 --lose-at 3

Ray's multi-node test cluster on this machine (tests/multinode_shared.py): a head, three rollout nodes with
one worker slot each (the tiny recipe's two workers and a spare slot) and a trainer node with both ranks. The
run loses the node of a worker (never the pool actor's) once step `--lose-at`'s requests are in flight
(TestCluster.lose: SIGKILL to its raylet and every process on it); the reference run, the same seed on the
same cluster, loses nothing. Figures: each run's step times; the lost step's against the reference's same
step and against the median of the run's steps before it; the requests in flight at the loss (those on the
lost node run again elsewhere); the seconds from the loss until the pool took the lost worker out of rotation
(its death seen) and until the replacement worker served. The lost run's rollouts and rewards must be the
reference's at every step (`same_rollouts`: the steps' rollout digests; `same_rewards`). `--no-reference`
leaves the reference run out, and every figure that compares with it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "configs" / "tiny.yaml"
ROLLOUT_SLOT, RANK_SLOT = "rollout_slot", "rank_slot"
NODES = {**{f"rollout{i}": {"cpus": 1, "resources": {ROLLOUT_SLOT: 1}} for i in (1, 2, 3)},
         "trainer1": {"cpus": 1, "resources": {RANK_SLOT: 1}}}
PLACEMENT = [f"rollout.resources_per_worker={{num_cpus: 0.5, resources: {{{ROLLOUT_SLOT}: 1}}}}",
             f"trainer.placement.resources_per_rank={{num_cpus: 0.5, resources: {{{RANK_SLOT}: 0.5}}}}"]


def _run(cfg, loss=None) -> list[dict]:
    """The job's records; `loss` (a NodeLoss watching its recovery) started with the job, and waited for before
    the job's pool goes (a replacement may still be starting when the last step ends)."""
    from recipes.grpo import GRPOJob
    from node_loss_shared import LOSS_BOUND_S
    if loss is not None:
        loss.start()
    records = []
    with contextlib.closing(GRPOJob(cfg).steps(progress=False)) as steps:
        for record in steps:
            records.append(record)
            if loss is not None and record["step"] == cfg.train.steps:
                loss.join(2 * LOSS_BOUND_S)
    return records


def _round(x: float) -> float:
    return round(x, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="steps of each run")
    ap.add_argument("--lose-at", type=int, default=3, help="the step whose rollouts lose a node (2 .. steps)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (rollout.n = 8 requests each)")
    ap.add_argument("--no-reference", action="store_true", help="leave the undisturbed reference run out")
    args = ap.parse_args()
    if not 2 <= args.lose_at <= args.steps:
        ap.error("--lose-at must be 2 .. --steps: the steps before it are the undisturbed ones")

    sys.path.insert(0, str(REPO / "tests"))  # the test cluster's helpers: tests/ is not an installed package
    from multinode_shared import test_cluster
    from node_loss_shared import NodeLoss, a_worker_node, rollouts_in_flight
    from recipes.config import load_config

    n = load_config(TINY).rollout.n
    out_dir = Path(tempfile.mkdtemp(prefix="node-loss-"))
    common = [f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}", "train.save_every=0",
              "train.save_final=false", "metrics.wandb=false", *PLACEMENT]
    with test_cluster(NODES, head_cpus=1) as cluster:
        reference = None
        if not args.no_reference:
            reference = _run(load_config(TINY, common + [f"run_dir={out_dir / 'reference'}"]))
        pool_name = f"node-loss-bench-{uuid.uuid4().hex[:6]}"
        loss = NodeLoss(cluster, pool_name, rollouts_in_flight(args.lose_at, args.prompts * n),
                        a_worker_node(cluster), watch_recovery=True)
        lost = _run(load_config(TINY, common + [f"rollout.pool_name={pool_name}", f"run_dir={out_dir / 'lost'}"]),
                    loss)
    if loss.error is not None:
        raise loss.error
    step_s = [r["perf/step_s"] for r in lost]
    k = args.lose_at - 1
    before = step_s[:k]
    result = {
        "steps": args.steps, "lose_at": args.lose_at, "requests_per_step": args.prompts * n,
        "lost_node": loss.victim, "requests_in_flight_at_loss": loss.stats_at_loss["in_flight"],
        "death_seen_s": None if loss.seen_s is None else _round(loss.seen_s),
        "replacement_serving_s": None if loss.recovered_s is None else _round(loss.recovered_s),
        "step_s": [_round(s) for s in step_s], "rollout_s": [_round(r["perf/rollout_s"]) for r in lost],
        "lost_step_s": _round(step_s[k]), "median_step_s_before": _round(statistics.median(before)),
        "lost_step_over_before": _round(step_s[k] / statistics.median(before)),
        "kl_zero_every_step": all(r["rollout_train/kl"] == 0.0 for r in lost),
    }
    if reference is not None:
        ref_s = [r["perf/step_s"] for r in reference]
        result.update({
            "reference_step_s": [_round(s) for s in ref_s], "reference_lost_step_s": _round(ref_s[k]),
            "lost_step_over_reference": _round(step_s[k] / ref_s[k]),
            "same_rollouts": [r["rollout/digest"] for r in lost] == [r["rollout/digest"] for r in reference],
            "same_rewards": [r["reward/mean"] for r in lost] == [r["reward/mean"] for r in reference]})
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
