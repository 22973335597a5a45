"""The GRPO recipe on a Ray cluster of several nodes (a head and nodes a and b, each a raylet of its own with
its own resources, tests/multinode_shared.py): rollout workers and trainer ranks where the config puts
them (each actor asked for its node), weights pushed from a rank on one node to workers on another, KL and
max |Δ log-prob| exactly 0.0 at every step; the same run with the nodes' resources swapped lands the other
way round and, resumed from the first run's checkpoint, takes the same step bit for bit; the placement
strategies spread and pack; a rank whose node does not see the run directory is refused at the start;
and `ray job submit --working-dir .` runs the recipe on the cluster."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from recipes.config import ConfigError, load_config
from recipes.grpo import GRPOJob
from recipes.metrics import read_metrics
from recipes.placement import bundle_nodes, placement_bundles, reserve_job_placement
from multinode_shared import (
    apart_head_args,
    apart_node_args,
    node_of_actor,
    node_resource,
    test_cluster,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "configs" / "tiny.yaml"
# two steps of 8 prompts x 8 samples at T=0.8; a checkpoint after each step
SHORT = ["train.steps=2", "train.prompts_per_step=8", "train.save_every=1", "warmup.steps=30",
         "rollout.temperature=0.8", "metrics.wandb=false"]


def pinned(workers_on: str, ranks_on: str) -> list[str]:
    """Overrides that put both rollout workers on node `workers_on` and both ranks on node `ranks_on`, by
    each node's custom resource (half a unit an actor)."""
    return [f"rollout.resources_per_worker={{num_cpus: 0.5, resources: {{{node_resource(workers_on)}: 0.5}}}}",
            f"trainer.placement.resources_per_rank={{num_cpus: 0.5, resources: {{{node_resource(ranks_on)}: 0.5}}}}"]


def test_bundles_keep_each_actors_custom_resources():
    """Split: a worker's bundle holds its node resource, a rank's its own; colocated: one bundle holds both
    actors' resources, summed (Ray would otherwise place a bundle on a node the actor cannot run on)."""
    split = load_config(TINY, pinned("a", "b") + ["rollout.resources_per_worker.memory=1000"])
    a, b = node_resource("a"), node_resource("b")
    assert placement_bundles(split) == ([{"CPU": 0.5, "memory": 1000, a: 0.5}] * 2 + [{"CPU": 0.5, b: 0.5}] * 2)
    colocated = load_config(TINY, ["placement=colocated", *pinned("a", "a")])
    assert placement_bundles(colocated) == [{"CPU": 1.0, a: 1.0}] * 2


@pytest.mark.parametrize("overrides,refusal", [
    (["rollout.placement_strategy=SPREAD_OUT"], "rollout.placement_strategy must be one of PACK"),
    (["trainer.placement.strategy=pack"], "trainer.placement.strategy must be one of PACK"),
    (["placement=colocated", "rollout.placement_strategy=SPREAD"], "placement colocated puts each worker"),
    (["rollout.placement_strategy=SPREAD", "rollout.engine.tensor_parallel_size=2"], "tensor_parallel_size > 1"),
])
def test_placement_strategies_are_checked_at_load(overrides, refusal):
    with pytest.raises(ConfigError, match=refusal):
        load_config(TINY, overrides)


@pytest.fixture(scope="module")
def cluster():
    """Head (the driver's node, 1 CPU, with the dashboard that `ray job submit` talks to) and nodes a and b
    (2 CPUs each), apart from other Ray clusters on this machine and from each other as separate machines
    are (multinode_shared.apart_head_args, apart_node_args)."""
    nodes = {name: {"cpus": 2, **apart_node_args(name)} for name in ("a", "b")}
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        with test_cluster(nodes, head_cpus=1, dashboard=True, head_args=apart_head_args(temp_dir, True)) as c:
            yield c
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def run_recording_nodes(cfg, resume=None) -> tuple[list[dict], dict]:
    """A job's step records, and the node each of its actors reported during its first step."""
    job = GRPOJob(cfg, resume)
    records, nodes = [], None
    for record in job.steps(progress=False):
        records.append(record)
        if nodes is None:
            nodes = {"workers": [node_of_actor(w) for w in job.pool.workers()],
                     "ranks": [node_of_actor(r) for r in job.trainer.ranks]}
    assert job.pool is None and job.trainer is None  # torn down
    return records, nodes


def assert_zero_kl(records: list[dict]) -> None:
    for rec in records:
        assert rec["rollout_train/kl"] == 0.0, rec
        assert rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        assert rec["rollout_train/mismatched_tokens"] == 0, rec
        assert rec["rollout_train/tokens"] > 0


@pytest.fixture(scope="module")
def workers_on_a(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("shared") / "run"
    cfg = load_config(TINY, SHORT + pinned("a", "b") + [f"run_dir={run_dir}"])
    records, nodes = run_recording_nodes(cfg)
    return run_dir, records, nodes


@pytest.mark.slow  # on the module's cluster of three raylets
def test_workers_and_ranks_on_the_nodes_the_config_names(cluster, workers_on_a):
    run_dir, records, nodes = workers_on_a
    assert nodes == {"workers": [cluster.node_id("a")] * 2, "ranks": [cluster.node_id("b")] * 2}
    assert [r["step"] for r in records] == [1, 2]
    assert_zero_kl(records)
    assert_zero_kl(read_metrics(run_dir))
    # every push went from rank 0 on node b to the workers on node a, through Ray's object store
    assert {r["weights/transport"] for r in records} == {"object_store"}
    assert len({r["weights/digest"] for r in records}) == 2  # each step's push carried new weights


@pytest.mark.slow  # on the module's cluster of three raylets
def test_swapped_nodes_land_the_other_way_and_resume_the_same_step(cluster, workers_on_a, tmp_path):
    """The same config with the nodes' resources swapped puts the workers on b and the ranks on a; resumed
    from the first run's step-1 checkpoint (its shards written by ranks on node b, read by ranks on node
    a), its step 2 has the first run's rollouts and weights, bit for bit."""
    first_dir, first, _ = workers_on_a
    cfg = load_config(TINY, SHORT + pinned("b", "a") + [f"run_dir={tmp_path / 'swapped'}"])
    records, nodes = run_recording_nodes(cfg, resume=first_dir / "checkpoints" / "step_000001")
    assert nodes == {"workers": [cluster.node_id("b")] * 2, "ranks": [cluster.node_id("a")] * 2}
    assert [r["step"] for r in records] == [2]
    assert_zero_kl(records)
    assert records[0]["rollout/digest"] == first[1]["rollout/digest"]
    assert records[0]["weights/digest"] == first[1]["weights/digest"]


@pytest.mark.slow  # on the module's cluster of three raylets
@pytest.mark.parametrize("strategy,nodes", [("STRICT_SPREAD", 2), ("STRICT_PACK", 1)])
def test_placement_strategies_spread_and_pack(cluster, strategy, nodes):
    """trainer.placement.strategy and rollout.placement_strategy place the job's groups: two bundles on two
    nodes (spread) or on one (pack)."""
    cfg = load_config(TINY, [f"trainer.placement.strategy={strategy}", f"rollout.placement_strategy={strategy}"])
    placement = reserve_job_placement(cfg)
    try:
        assert len(set(placement.rank_nodes())) == nodes
        assert len(set(bundle_nodes(placement.workers))) == nodes
    finally:
        placement.release()


def own_disk_wrapper(tmp_path: Path, shared: Path, node_local: Path) -> str:
    """A runtime_env py_executable under which a rank's process sees `node_local` at the path `shared` (a
    mount namespace of its own): a node whose disk at that path is not the driver's."""
    script = tmp_path / "own_disk.sh"
    unshare = "unshare --mount" + ("" if os.geteuid() == 0 else " --map-root-user")
    script.write_text("#!/bin/sh\n"
                      f"exec {unshare} sh -c 'mount --bind \"$0\" \"$1\" && shift && exec \"$@\"' "
                      f"'{node_local}' '{shared}' \"$@\"\n")
    script.chmod(0o755)
    return f"{script} {sys.executable}"


@pytest.mark.slow  # on the module's cluster of three raylets
def test_a_rank_that_does_not_see_the_run_directory_is_refused(cluster, tmp_path):
    """Ranks on node b whose processes see another directory at output_dir: the job refuses at the start,
    naming the run directory and the node, before any worker or rank starts, and leaves nothing reserved."""
    shared, node_local = tmp_path / "runs", tmp_path / "node_b_disk"
    shared.mkdir()
    node_local.mkdir()
    wrapper = own_disk_wrapper(tmp_path, shared, node_local)
    overrides = SHORT + pinned("a", "b")
    overrides[-1] = ("trainer.placement.resources_per_rank={num_cpus: 0.5, resources: "
                     f"{{{node_resource('b')}: 0.5}}, runtime_env: {{py_executable: '{wrapper}'}}}}")
    cfg = load_config(TINY, overrides + [f"output_dir={shared}"])
    job = GRPOJob(cfg)
    start = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        next(job.steps(progress=False))
    message = str(refused.value)
    assert str(job.run_dir) in message and cluster.node_id("b") in message, message
    assert "does not see the driver's probe file" in message, message
    assert time.monotonic() - start < 120
    assert job.pool is None and job.trainer is None
    assert list(node_local.iterdir()) == []  # the rank's side saw an empty disk and wrote nothing
    deadline = time.monotonic() + 10  # the ranks' placement group was released
    while ray.available_resources().get(node_resource("b"), 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get(node_resource("b"), 0) == 1


@pytest.mark.slow  # on the module's cluster of three raylets
def test_ray_job_submit_runs_the_recipe_on_the_cluster(cluster, tmp_path):
    """`ray job submit --working-dir . -- python -m recipes.grpo ...` from the repository: the job
    SUCCEEDED, its workers on node a and ranks on node b, and its metrics show KL 0.0 at every step."""
    from ray.job_submission import JobStatus, JobSubmissionClient
    run_dir = tmp_path / "submitted"
    submission = f"multinode-recipe-{uuid.uuid4().hex[:8]}"
    cmd = [shutil.which("ray") or "ray", "job", "submit", "--address", cluster.dashboard_url,
           "--submission-id", submission, "--working-dir", ".", "--",
           "python", "-m", "recipes.grpo", "--config", "recipes/configs/tiny.yaml", "--no-progress",
           "--run-dir", str(run_dir), "train.save_every=0", *SHORT[:2], *SHORT[3:], *pinned("a", "b")]
    done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = done.stdout[-3000:] + done.stderr[-3000:]
    try:
        status = JobSubmissionClient(cluster.dashboard_url).get_job_status(submission)
    except RuntimeError as error:  # the submission never became a job (e.g. the working dir's upload failed)
        pytest.fail(f"{error}\n`ray job submit` said:\n{output}")
    assert status == JobStatus.SUCCEEDED, output
    logged = read_metrics(run_dir)
    assert [r["step"] for r in logged] == [1, 2]
    assert_zero_kl(logged)
