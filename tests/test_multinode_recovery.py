"""The tiny GRPO recipe on a multi-node Ray cluster (tests/multinode_shared.py) losing a node or its driver, each
run compared step for step with an undisturbed run of the same seed:

- a rollout node lost while a step's rollouts are in flight: its worker comes back on a node left, the step
  completes, the pool counts every request once, and every rollout, reward and weight digest is the undisturbed
  run's, with KL 0.0;
- a trainer node lost: the job stops with TrainerRankLost naming the rank, its node and `--resume <run_dir>`;
  resumed on the nodes left it runs the undisturbed run's steps;
- the driver killed (SIGKILL) after a checkpoint: `--resume <run_dir>` runs the undisturbed run's steps, its
  fixed pool name free again.

Workers and ranks are placed by custom resources that several nodes offer (a slot per node), not by a node's
own name (node_resource): a worker pinned to a node by name could never come back elsewhere. Checkpoints are
read back from the nodes left because every node of this cluster shares this machine's disk.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from recipes.config import load_config  # noqa: E402
from recipes.grpo import GRPOJob, main, run  # noqa: E402
from recipes.metrics import read_metrics  # noqa: E402
from recipes.rank_loss import TrainerRankLost  # noqa: E402
from rollout_service.service.client import RolloutClient  # noqa: E402
from multinode_shared import test_cluster  # noqa: E402
from node_loss_shared import (  # noqa: E402
    LOSS_BOUND_S,
    NodeLoss,
    a_worker_node,
    all_ready,
    nodes_of,
    rollouts_in_flight,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "configs" / "tiny.yaml"
STEPS, PROMPTS, N = 3, 8, 8  # tiny.yaml's rollout.n is 8
REQUESTS_PER_STEP = PROMPTS * N
RUN = [f"train.steps={STEPS}", f"train.prompts_per_step={PROMPTS}", "train.save_every=2", "train.save_rollouts=true",
       "warmup.steps=30", "rollout.temperature=0.8", "metrics.wandb=false"]
# Three rollout nodes with one worker slot each (two workers, one spare slot) and two trainer nodes with one
# rank slot each; the head holds the driver.
ROLLOUT_SLOT, RANK_SLOT = "rollout_slot", "rank_slot"
NODES = {**{f"rollout{i}": {"cpus": 1, "resources": {ROLLOUT_SLOT: 1}} for i in (1, 2, 3)},
         **{f"trainer{i}": {"cpus": 1, "resources": {RANK_SLOT: 1}} for i in (1, 2)}}
WORKERS_ON_SLOTS = f"rollout.resources_per_worker={{num_cpus: 0.5, resources: {{{ROLLOUT_SLOT}: 1}}}}"
RANK_PER_NODE = f"trainer.placement.resources_per_rank={{num_cpus: 0.5, resources: {{{RANK_SLOT}: 1}}}}"
RANKS_ANYWHERE = f"trainer.placement.resources_per_rank={{num_cpus: 0.5, resources: {{{RANK_SLOT}: 0.5}}}}"


@pytest.fixture(scope="module")
def cluster():
    with test_cluster(NODES, head_cpus=1) as running:
        yield running


@pytest.fixture(scope="module")
def undisturbed(cluster, tmp_path_factory):
    """The reference: the same run with nothing lost (run directory, records by step)."""
    run_dir = tmp_path_factory.mktemp("undisturbed")
    result = run(load_config(TINY, RUN + [WORKERS_ON_SLOTS, RANKS_ANYWHERE, f"run_dir={run_dir}"]), progress=False)
    return run_dir, {r["step"]: r for r in result["records"]}


def _rollout_bits(run_dir: Path, step: int) -> list[tuple]:
    """Each saved rollout of a step: its tokens, the exact bits of its log-probs, its reward and versions."""
    lines = (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    out = []
    for line in map(json.loads, lines):
        out.append((tuple(line["prompt"]), tuple(line["tokens"]), struct.pack(f"<{len(line['logprobs'])}d",
                    *line["logprobs"]), line["reward"], tuple(line["weight_versions"]), line["finish_reason"]))
    return out


def assert_same_steps(run_dir: Path, records: dict, undisturbed, steps) -> None:
    """Steps `steps` of run_dir (its records) are the undisturbed run's: the same rollouts bit for bit, the
    same rewards, KL exactly 0.0 and the same weights after the update."""
    ref_dir, ref = undisturbed
    assert sorted(records) == list(steps)
    for step in steps:
        got, want = records[step], ref[step]
        assert len(_rollout_bits(run_dir, step)) == REQUESTS_PER_STEP
        assert _rollout_bits(run_dir, step) == _rollout_bits(ref_dir, step), f"step {step}"
        assert got["rollout/digest"] == want["rollout/digest"], f"step {step}"
        assert got["reward/mean"] == want["reward/mean"], f"step {step}"
        assert got["rollout_train/kl"] == 0.0 == want["rollout_train/kl"], f"step {step}"
        assert got["rollout_train/max_abs_logprob_diff"] == 0.0, f"step {step}"
        assert got["weights/digest"] == want["weights/digest"], f"step {step}"


def test_rollout_node_lost_mid_step_keeps_every_request_and_bit(cluster, undisturbed, tmp_path):
    pool_name = f"node-loss-{uuid.uuid4().hex[:6]}"
    cfg = load_config(TINY, RUN + [WORKERS_ON_SLOTS, RANKS_ANYWHERE, f"rollout.pool_name={pool_name}",
                                   f"run_dir={tmp_path}"])
    assert len([n for n in cluster.nodes if n.startswith("rollout")]) == 3, "two workers and a spare slot"
    loss = NodeLoss(cluster, pool_name, rollouts_in_flight(2, REQUESTS_PER_STEP), a_worker_node(cluster))
    loss.start()
    records, end, worker_nodes = {}, None, None
    with contextlib.closing(GRPOJob(cfg).steps(progress=False)) as steps:
        for record in steps:
            records[record["step"]] = record
            if record["step"] == STEPS:  # the pool still runs: wait for the replacement, read its counts
                pool, deadline = RolloutClient(pool_name), time.monotonic() + LOSS_BOUND_S
                end = pool.stats()
                while not (all_ready(end) and any(w["restarts"] for w in end["workers"])):
                    assert time.monotonic() < deadline, end["workers"]
                    time.sleep(0.2)
                    end = pool.stats()
                worker_nodes = nodes_of(cluster, pool.workers())
    loss.join(1)
    assert loss.error is None, loss.error
    at_loss = loss.stats_at_loss
    assert REQUESTS_PER_STEP < at_loss["submitted"] and 2 * at_loss["in_flight"] >= REQUESTS_PER_STEP, at_loss
    # the lost worker's slot came back on a node left; the other worker never moved
    assert loss.victim not in worker_nodes and set(worker_nodes) <= set(cluster.nodes) | {"head"}
    assert sorted(w["restarts"] for w in end["workers"]) == [0, 1]
    # every request counted once: the ones in flight on the lost node were run again, none lost or doubled
    total = STEPS * REQUESTS_PER_STEP
    assert end["submitted"] == end["completed"] == total, end
    assert end["errors"] == end["aborted"] == 0 and end["in_flight"] == 0, end
    assert 1 <= end["retried"] <= at_loss["in_flight"], end
    assert_same_steps(tmp_path, records, undisturbed, range(1, STEPS + 1))


def test_trainer_node_lost_stops_the_job_then_resume_continues(cluster, undisturbed, tmp_path):
    pool_name = f"node-loss-{uuid.uuid4().hex[:6]}"
    cfg = load_config(TINY, RUN + [WORKERS_ON_SLOTS, RANK_PER_NODE, f"rollout.pool_name={pool_name}",
                                   f"run_dir={tmp_path}"])
    checkpoint_2 = tmp_path / "checkpoints" / "step_000002" / "state.json"
    trainer_nodes = [n for n in cluster.nodes if n.startswith("trainer")]
    assert len(trainer_nodes) == 2, "this test loses one of the two trainer nodes"

    def a_rank_node(pool, pool_node: str) -> str:  # one rank a node: either holds a rank
        return next(n for n in trainer_nodes if n != pool_node)

    loss = NodeLoss(cluster, pool_name, lambda pool: checkpoint_2.is_file(), a_rank_node)
    loss.start()
    with pytest.raises(TrainerRankLost) as lost:
        run(cfg, progress=False)
    stopped_after = time.monotonic() - loss.lost_at
    loss.join(1)
    assert loss.error is None, loss.error
    error = lost.value
    assert error.node is not None and error.node["node_id"] == loss.victim_id
    assert f"trainer rank {error.rank} on node {error.node['node_id']}" in str(error)
    assert f"--resume {tmp_path}" in str(error) and error.run_dir == str(tmp_path)
    assert stopped_after < LOSS_BOUND_S
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # step 3 never finished
    # resumed on the nodes left: both ranks on the one trainer node
    result = main(["--resume", str(tmp_path), "--no-progress", RANKS_ANYWHERE])
    assert_same_steps(tmp_path, {r["step"]: r for r in result["records"]}, undisturbed, range(3, STEPS + 1))
    assert [r["reward/mean"] for r in read_metrics(tmp_path)] == [
        undisturbed[1][s]["reward/mean"] for s in range(1, STEPS + 1)]


def test_driver_killed_after_a_checkpoint_resumes_the_same_steps(cluster, undisturbed, tmp_path):
    run_dir = tmp_path / "run"
    # a fixed pool name: the resumed run starts its pool under the killed driver's
    overrides = RUN + [WORKERS_ON_SLOTS, RANKS_ANYWHERE, "rollout.pool_name=node-loss-driver"]
    env = dict(os.environ, HOME=tempfile.mkdtemp(dir=tmp_path), RAY_ADDRESS=cluster.address)
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        driver = subprocess.Popen([sys.executable, "-m", "recipes.grpo", "--config", str(TINY), "--run-dir",
                                   str(run_dir), "--no-progress", *overrides], cwd=REPO, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 2 * LOSS_BOUND_S
        while not (run_dir / "checkpoints" / "step_000002" / "state.json").is_file():
            assert driver.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.01)
        driver.send_signal(signal.SIGKILL)
        assert driver.wait(30) == -signal.SIGKILL
    finally:
        if driver.poll() is None:
            driver.kill()
    result = main(["--resume", str(run_dir), "--no-progress"])
    records = {r["step"]: r for r in result["records"]}
    assert min(records) == 3  # from the checkpoint of step 2, whatever the killed driver did after it
    assert_same_steps(run_dir, records, undisturbed, range(3, STEPS + 1))
    assert [r["reward/mean"] for r in read_metrics(run_dir)] == [
        undisturbed[1][s]["reward/mean"] for s in range(1, STEPS + 1)]
