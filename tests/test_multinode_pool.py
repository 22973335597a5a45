"""One rollout pool across several Ray nodes (Ray's multi-node test cluster, tests/multinode_shared.py): the
pool's actor pinned to the driver's node, workers spread over the others and restarted on a live node when
theirs is lost (every request completes once, with the bits of an undisturbed run), a second driver on
another node served the same bits by name, the errors of bad input in bounded time, and a restartable
pool whose own actor dies and comes back serving the same weights, adapters and bits."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import service_shared as shared  # noqa: E402
from conftest import rollout_bits  # noqa: E402
from multinode_shared import node_of_actor, node_resource, test_cluster  # noqa: E402
from service_shared import ENGINE_KWARGS, assert_same  # noqa: E402

from rollout_service import SamplingParams, start_pool  # noqa: E402
from rollout_service.service.client import RolloutClient  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SLOT = "rollout_slot"  # what a worker node offers one of: one worker a node
WORKERS = {"num_cpus": 1, "resources": {SLOT: 1}}
PROMPTS = [[1 + i % 11, 2 + i % 5, 3 + i % 7] for i in range(8)]
PARAMS = [SamplingParams(max_tokens=24, temperature=1.0, seed=i) for i in range(8)]
POOL = "mn-pool"


def _node(name: str, tmp: Path) -> dict:
    # a temp dir of its own, so that a driver can attach to this node (ray.init(_temp_dir=...))
    return dict(cpus=1, resources={SLOT: 1}, temp_dir=str(tmp / name))


@pytest.fixture(scope="module")
def cluster():
    tmp = Path(tempfile.mkdtemp(prefix="zk", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        with test_cluster({name: _node(name, tmp) for name in ("a", "b")}) as c:
            c.tmp = tmp
            yield c
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def pool(cluster):
    client = start_pool(shared.model(), num_workers=2, name=POOL, engine_kwargs=ENGINE_KWARGS,
                        resources_per_worker=WORKERS, start_timeout_s=120)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def undisturbed(pool):
    """The rollouts of PROMPTS/PARAMS on the pool with every node up."""
    return pool.generate(PROMPTS, PARAMS)


def _names(cluster) -> dict:
    """node id -> name of the live nodes."""
    return {cluster.node_id(n): n for n in ["head", *cluster.nodes]}


def _wait(cond, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.1)


def test_pool_actor_on_the_drivers_node_and_workers_spread(cluster, pool, undisturbed):
    assert all(r.ok for r in undisturbed)
    names = _names(cluster)
    assert names[node_of_actor(pool._pool)] == "head" == names[pool.stats()["pool_node"]]
    worker_nodes = [names[node_of_actor(w)] for w in pool.workers()]
    assert len(set(worker_nodes)) == 2 and "head" not in worker_nodes, worker_nodes


def test_a_second_driver_on_another_node_gets_the_same_bits(cluster, pool, undisturbed):
    """A driver process attached to node "b" finds the pool by name and is served the same rollouts."""
    code = f"""
import json, struct, ray
ray.init(address={cluster.address!r}, _temp_dir={str(cluster.tmp / 'b')!r}, log_to_driver=False)
from rollout_service import SamplingParams
from rollout_service.service.client import RolloutClient
client = RolloutClient({POOL!r})
out = client.generate({PROMPTS!r}, [SamplingParams(max_tokens=24, temperature=1.0, seed=i) for i in range(8)])
print(json.dumps({{"node": ray.get_runtime_context().get_node_id(), "digest": client.weights_digest(),
                  "rollouts": [[r.finish_reason, r.token_ids, [struct.pack("<d", x).hex() for x in r.logprobs]]
                               for r in out]}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["node"] == cluster.node_id("b") and got["digest"] == pool.weights_digest()
    want = [[r.finish_reason, list(r.token_ids), [b.hex() for b in rollout_bits(r)[2]]] for r in undisturbed]
    assert got["rollouts"] == want


@pytest.mark.slow  # a node lost and a worker restarted elsewhere: ~20 s on 2 cores
def test_losing_a_workers_node_mid_generation_loses_no_request(cluster, pool):
    cluster.add("c", **_node("c", cluster.tmp))  # a spare node, where the lost worker comes back
    prompts, params = PROMPTS * 2, [SamplingParams(max_tokens=160, temperature=1.0, seed=i) for i in range(16)]
    want = pool.generate(prompts, params)  # undisturbed: every node up
    names = _names(cluster)
    pool_node = node_of_actor(pool._pool)
    victim = names[node_of_actor(pool.workers()[0])]
    before = pool.stats()
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=pool.generate(prompts, params)))
    thread.start()
    _wait(lambda: pool.stats()["workers"][0]["in_flight"] > 0, pool.stats, 30)
    cluster.remove(victim)  # worker 0's node, mid-generation
    thread.join(120)
    assert not thread.is_alive()
    assert_same(result["out"], want, "after losing a worker's node")
    after = pool.stats()
    done = {k: after[k] - before[k] for k in ("submitted", "completed", "errors", "aborted")}
    assert done == {"submitted": 16, "completed": 16, "errors": 0, "aborted": 0}, done
    assert after["retried"] > before["retried"]  # the lost worker's requests ran again elsewhere
    served = sum(w["completed"] for w in after["workers"]) - sum(w["completed"] for w in before["workers"])
    assert served == 16  # each request served once: none lost, none counted twice
    _wait(lambda: pool.stats()["workers"][0]["state"] == "ready", pool.stats)
    names = _names(cluster)
    assert names[node_of_actor(pool.workers()[0])] not in (victim, "head")  # back on a live node
    assert node_of_actor(pool._pool) == pool_node  # the pool's actor never moved
    assert_same(pool.generate(prompts[:4], params[:4]), want[:4], "on the restarted worker")


def test_a_pool_name_in_another_namespace_is_named(cluster, pool):
    held_elsewhere = r"no rollout pool named 'mn-pool' in namespace 'elsewhere'.*\['rollout_service'\]"
    with pytest.raises(ValueError, match=held_elsewhere):
        RolloutClient(POOL, namespace="elsewhere")
    with pytest.raises(ValueError, match="no rollout pool named 'mn-nothing'") as info:
        RolloutClient("mn-nothing")
    assert "namespace(s)" not in str(info.value)


def test_an_unreachable_address_is_a_connection_error_in_seconds():
    """init_ray (recipes' --ray-address, RAY_ADDRESS) probes the address: a closed port on this machine."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    code = f"""
import os, time
from rollout_service.service.ray_cluster import init_ray
for how in ("argument", "RAY_ADDRESS"):
    t = time.monotonic()
    try:
        if how == "argument":
            init_ray("127.0.0.1:{port}")
        else:
            os.environ["RAY_ADDRESS"] = "127.0.0.1:{port}"
            init_ray()
    except ConnectionError as e:
        print(how, round(time.monotonic() - t, 2), e)
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the module's cluster sets it
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout + proc.stderr[-2000:]
    for line, how in zip(lines, ("argument", "RAY_ADDRESS")):
        got, seconds, message = line.split(" ", 2)
        assert got == how and float(seconds) < 6.0, line
        assert f"127.0.0.1:{port}" in message and "ray start --head" in message, line


def test_the_address_probed_is_the_one_ray_init_would_join():
    from rollout_service.service.ray_cluster import _host_port
    assert _host_port("head:6380") == ("head", 6380)
    assert _host_port("head") == ("head", 6379)  # `ray start --head`'s GCS port
    assert _host_port("ray://head") == ("head", 10001) and _host_port("ray://head:2") == ("head", 2)
    assert _host_port("[::1]:7000") == ("::1", 7000)
    with pytest.raises(ConnectionError, match="'head:gcs'"):
        _host_port("head:gcs")


def test_workers_no_node_can_hold_fail_in_bounded_time_naming_the_resource(cluster):
    t = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        start_pool(shared.model(), num_workers=1, name="mn-unplaceable",
                   resources_per_worker={"resources": {"gpu_node": 1}}, start_timeout_s=5)
    assert time.monotonic() - t < 20
    message = str(info.value)
    assert "'gpu_node': 1" in message and "start_timeout_s" in message, message
    assert "live nodes offers ['gpu_node'] at all" in message, message
    assert node_resource("head") in message  # the cluster's resources, custom ones included
    with pytest.raises(ValueError):
        ray.get_actor("mn-unplaceable", namespace="rollout_service")  # nothing left behind


@pytest.mark.slow  # a pool started, pushed to, killed and recovered: ~25 s on 2 cores
def test_a_restartable_pool_comes_back_with_its_weights_and_adapters(cluster, tmp_path):
    from lora_shared import ATTENTION, trained_adapter_model

    from rollout_service.lora import adapter_from_model
    from rollout_service.tiny_models import tiny_model
    checkpoint = tmp_path / "base"
    shared.model().save_pretrained(checkpoint)
    adapter = adapter_from_model(trained_adapter_model(checkpoint, 4, ATTENTION, steps=1, seed=3))
    pool = start_pool(shared.model(), num_workers=1, name="mn-restartable", engine_kwargs=ENGINE_KWARGS,
                      placement_group_bundles=[{"CPU": 1, node_resource("head"): 1}], max_restarts=-1,
                      detached=True)  # the head's only CPU: a restart that reserved it again would wait forever
    try:
        client = RolloutClient("mn-restartable", restart_wait_s=60)  # as another driver would
        digest = client.update_weights(tiny_model("qwen2", seed=1).state_dict())
        client.load_adapter("a", adapter, transport="broadcast")  # worker to worker: the keeper copies a worker's
        params = PARAMS[:4] + [SamplingParams(max_tokens=24, temperature=1.0, seed=9, adapter="a")] * 2
        prompts = PROMPTS[:6]
        want, stats = client.generate(prompts, params), client.stats()
        assert stats["weight_version"] == 2 and stats["pool_restarts"] == 0
        assert stats["pool_node"] == cluster.node_id("head")
        adapters = client.adapters()

        result = {}
        thread = threading.Thread(target=lambda: result.update(out=client.generate(prompts, params)))
        thread.start()
        _wait(lambda: client.stats()["in_flight"] > 0, client.stats, 30)
        ray.kill(client._pool, no_restart=False)  # the pool's own process dies; Ray restarts it
        thread.join(120)
        assert not thread.is_alive()
        assert_same(result["out"], want, "in flight across the pool's restart")
        assert_same(client.generate(prompts, params), want, "after the pool's restart")
        after = client.stats()
        assert after["pool_restarts"] == 1 and after["digest"] == digest == client.weights_digest()
        assert after["weight_version"] == 2 and client.adapters() == adapters
        assert after["pool_node"] == cluster.node_id("head")
        reserved = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        assert len(reserved) == 1, reserved  # the worker's reservation, reused across the restart
        assert_same(pool.generate(prompts, params), want, "through start_pool's own client")
    finally:
        pool.shutdown()
    _wait(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == "mn-restartable"],
          lambda: "the pool's name is still registered")


def test_losing_every_other_node_keeps_the_pool(cluster, pool):
    """Every node but the driver's goes: the pool's actor, pinned there, still answers (its workers wait,
    restarting, for a node to take them). Last: it leaves the module's pool without worker nodes, and dead."""
    pool_node = node_of_actor(pool._pool)
    assert pool_node == cluster.node_id("head")
    for name in list(cluster.nodes):
        cluster.remove(name)
    stats = pool.stats()
    assert stats["pool_node"] == pool_node and node_of_actor(pool._pool) == pool_node
    _wait(lambda: all(w["state"] == "restarting" for w in pool.stats()["workers"]), pool.stats, 30)
    # a pool without max_restarts that dies is said at once, not waited for as a restart
    ray.kill(pool._pool, no_restart=False)
    t = time.monotonic()
    with pytest.raises(ray.exceptions.ActorDiedError):
        while time.monotonic() - t < 10:  # the kill takes effect a moment later
            pool.stats()
            time.sleep(0.05)
    assert time.monotonic() - t < 10
