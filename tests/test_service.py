"""The Ray rollout service on a real local cluster: bits independent of workers, routing and order;
failure recovery; bad input; cancellation; weight sync; shutdown."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import kernels as K
import service_shared as shared
from service_shared import ENGINE_KWARGS, POOL_NAME, assert_same

ray = pytest.importorskip("ray")
from ray.exceptions import RayActorError  # noqa: E402

from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service import (CanonicalMismatchError, Engine, InvalidRequestError, RolloutClient,  # noqa: E402
                             SamplingParams, WeightMismatchError, start_pool)
from rollout_service.service.ray_cluster import with_tree_width  # noqa: E402
from rollout_service.weights import model_digest, state_dict_digest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def make_requests(n=24, seed=0):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append([rng.randrange(96) for _ in range(rng.randint(1, 12))])
        kind = i % 4
        if kind == 0:
            p = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0)
        elif kind == 1:
            p = SamplingParams(max_tokens=rng.randint(4, 12), temperature=1.0, seed=i)
        elif kind == 2:
            p = SamplingParams(max_tokens=rng.randint(4, 12), temperature=0.8, top_k=20, top_p=0.9, seed=i,
                               determinism="invariant")
        else:
            p = SamplingParams(max_tokens=12, temperature=1.2, seed=i, stop_token_ids=(rng.randrange(96),))
        params.append(p)
    return prompts, params


def wait_for(cond, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def service(request):
    shared.cluster()
    yield shared.pool()
    shared.release(request)


@pytest.fixture(scope="module")
def reqs():
    return make_requests()


@pytest.fixture(scope="module")
def reference(reqs):
    return Engine(shared.model(), **ENGINE_KWARGS).generate(*reqs)


@pytest.fixture(scope="module")
def pool1(service):
    # One worker in its own placement group: the option GPU clusters use, here with a CPU bundle.
    pool = start_pool(shared.model(), num_workers=1, name="rollout-1", engine_kwargs=ENGINE_KWARGS,
                       placement_group_bundles=[{"CPU": 1}])
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def pool3(service):
    pool = start_pool(shared.model(), num_workers=3, name="rollout-3", engine_kwargs=ENGINE_KWARGS)
    yield pool
    pool.shutdown()


def run_in_many_orders(client, prompts, params, reference):
    n = len(prompts)
    assert_same(client.generate(prompts, params), reference, "one call, in order")

    # Shuffled, one call per request, all in flight at once.
    order = random.Random(1).sample(range(n), n)
    refs = [client.submit([prompts[i]], params[i])[0] for i in order]
    assert_same([ray.get(r)[0] for r in refs], [reference[i] for i in order], "shuffled singles")

    # Three threads with sync calls over interleaved slices, while async calls add other traffic.
    got = {}

    def thread(k):
        idx = list(range(n))[k::3][::-1]
        for i, r in zip(idx, client.generate([prompts[i] for i in idx], [params[i] for i in idx])):
            got[i] = r

    async def noise():
        await asyncio.gather(*(client.generate_async([[j % 96, 5]], SamplingParams(max_tokens=8, temperature=1.0,
                                                                                 seed=j)) for j in range(30)))
    threads = [threading.Thread(target=thread, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    asyncio.run(noise())
    for t in threads:
        t.join()
    assert_same([got[i] for i in range(n)], reference, "threads + background traffic")


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_bits_independent_of_workers_routing_and_order(num_workers, request, service, reqs, reference):
    pool = request.getfixturevalue({1: "pool1", 2: "service", 3: "pool3"}[num_workers])
    before = pool.stats()
    run_in_many_orders(pool, *reqs, reference)
    after = pool.stats()
    assert after["errors"] == before["errors"]
    # every worker took part
    assert all(a["completed"] > b["completed"] for a, b in zip(after["workers"], before["workers"]))


def test_killed_worker_loses_nothing(pool3):
    prompts = [[(7 * i) % 95 + 1, i % 50 + 2] for i in range(48)]
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=100 + i) for i in range(48)]
    want = Engine(shared.model(), **ENGINE_KWARGS).generate(prompts, params)
    before = pool3.stats()
    victim = pool3.workers()[1]

    ref, _ = pool3.submit(prompts, params)
    wait_for(lambda: pool3.stats()["workers"][1]["in_flight"] > 0, what="requests on the victim")
    ray.kill(victim)
    got = ray.get(ref, timeout=300)

    assert_same(got, want, "after a worker was killed")
    after = pool3.stats()
    assert after["retried"] > before["retried"]  # its requests really were re-run elsewhere
    assert after["errors"] == before["errors"]
    wait_for(lambda: pool3.stats()["workers"][1]["state"] == "ready", what="the worker's restart")
    stats = pool3.stats()["workers"][1]
    assert stats["restarts"] == 1 and stats["pid"] != before["workers"][1]["pid"]
    with pytest.raises(RayActorError):
        ray.get(victim.load.remote(), timeout=60)
    # the replacement serves like the others
    completed = stats["completed"]
    assert_same(pool3.generate(prompts[:24], params[:24]), want[:24], "after the restart")
    assert pool3.stats()["workers"][1]["completed"] > completed


def test_weight_versions_under_concurrent_pushes_and_a_worker_death(pool3):
    """Waves of requests while two pushes land and a worker is killed: every request comes back once,
    stamped with one weight version (a push waits until none is in flight), and its bits are those of an
    engine holding that version's weights. All three versions serve some."""
    weights = [shared.model(), tiny_model("qwen2", seed=2), tiny_model("qwen2", seed=3)]
    first = pool3.stats()["weight_version"]
    prompts = [[(5 * i) % 95 + 1, i % 40 + 3] for i in range(48)]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=300 + i) for i in range(48)]
    got: dict[int, object] = {}
    pushed = {1: threading.Event(), 2: threading.Event()}

    def waves():  # waves 0-1 race push 1, 2-3 push 2; waves 2 and 4 start only after push 1 and 2
        for w in range(6):
            if w in (2, 4):
                pushed[w // 2].wait(600)
            idx = list(range(8 * w, 8 * w + 8))
            for i, ro in zip(idx, pool3.generate([prompts[i] for i in idx], [params[i] for i in idx])):
                assert i not in got
                got[i] = ro

    sender = threading.Thread(target=waves)
    sender.start()
    for push, model in enumerate(weights[1:], start=1):
        wait_for(lambda: len(got) >= 16 * push - 8, what=f"a wave before push {push}")
        if push == 2:
            ray.kill(pool3.workers()[0])  # its requests are re-run elsewhere, on the version they were on
        pool3.update_weights(model.state_dict())
        assert pool3.stats()["weight_version"] == first + push
        pushed[push].set()
    sender.join(timeout=600)
    assert sorted(got) == list(range(48))
    by_version: dict[int, list[int]] = {}
    for i, ro in got.items():
        assert ro.ok and len(set(ro.weight_versions)) == 1 and len(ro.weight_versions) == len(ro.token_ids), i
        by_version.setdefault(ro.weight_versions[0] - first, []).append(i)
    assert sorted(by_version) == [0, 1, 2], by_version
    for version, idx in by_version.items():
        want = Engine(weights[version], **ENGINE_KWARGS).generate([prompts[i] for i in idx], [params[i] for i in idx])
        assert_same([got[i] for i in idx], want, f"version {first + version}")
    # the weights the other tests expect, once the killed worker is back
    wait_for(lambda: all(w["state"] == "ready" for w in pool3.stats()["workers"]), what="the restart")
    pool3.update_weights(shared.model().state_dict())


def test_bad_input_fails_only_that_request(service, reqs, reference):
    client = RolloutClient(POOL_NAME)  # by name, like any other driver
    good = SamplingParams(max_tokens=4, temperature=0)
    broken = SamplingParams(max_tokens=4, temperature=0)
    object.__setattr__(broken, "max_tokens", 0)  # slipped past construction-time validation
    cases = [  # (prompt, params, words the error must contain)
        ([5, 96], good, "outside [0, 96)"),
        ([-1, 3], good, "outside"),
        ([], good, "empty"),
        ("hello", good, "int token ids"),
        ([1.5, 2], good, "int token ids"),
        ([True, 2], good, "int token ids"),
        ([1] * 600, good, "max_model_len"),
        ([3, 4], broken, "max_tokens"),
    ]
    prompts = [reqs[0][0]] + [c[0] for c in cases] + [reqs[0][1]]
    params = [reqs[1][0]] + [c[1] for c in cases] + [reqs[1][1]]
    out = client.generate(prompts, params)
    assert_same([out[0], out[-1]], reference[:2], "good requests next to bad ones")
    for (_, _, words), r in zip(cases, out[1:-1]):
        assert r.finish_reason == "error" and not r.ok and not r.token_ids
        assert "InvalidRequestError" in r.error and words in r.error, r.error

    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=0)  # bad params are refused before they are sent
    with pytest.raises(ValueError, match="prompts but"):
        client.generate([[1], [2]], [good] * 3)
    # a call that is not a batch of requests raises at once (rollout_service.params.check_batch)
    for prompts, params, words in ((5, good, "list of prompts"), ([1, 2, 3], good, "single prompt"),
                                   ([[1, 2]], {"max_tokens": 4}, "SamplingParams"),
                                   ([[1, 2], [3]], [good, {"max_tokens": 4}], "SamplingParams")):
        with pytest.raises(TypeError, match=words):
            client.generate(prompts, params)
    with pytest.raises(ValueError, match="unique"):
        client.generate([[1], [2]], good, request_ids=["a", "a"])

    # a request id already in use is an error for that request only
    long = SamplingParams(max_tokens=200, temperature=0, determinism="invariant")
    first, _ = client.submit([[9, 9]], long, request_ids=["same-id"])
    wait_for(lambda: client.stats()["in_flight"] > 0, what="the first request")
    [dup] = client.generate([[9, 9]], good, request_ids=["same-id"])
    assert dup.finish_reason == "error" and "duplicate" in dup.error
    client.cancel("same-id")
    assert ray.get(first)[0].finish_reason == "abort"

    sd = {k: v.clone() for k, v in shared.model().state_dict().items()}
    name = "model.layers.0.mlp.up_proj.weight"
    wrong_shape = {**sd, name: torch.zeros(3, 3, dtype=torch.bfloat16)}
    wrong_name = {("model.layers.0.mlp.up.weight" if k == name else k): v for k, v in sd.items()}
    not_finite = {**sd, name: torch.full_like(sd[name], float("nan"))}
    for bad, words in ((wrong_shape, "wrong shape"), (wrong_name, "missing"), (not_finite, "finite")):
        with pytest.raises(WeightMismatchError, match=words):
            client.update_weights(bad)
    for bad, words in (([1, 2], "state dict"), ({name: [1.0, 2.0]}, "torch.Tensor"), (None, "state dict")):
        with pytest.raises(TypeError, match=words):  # at the call, before anything is sent
            client.update_weights(bad)
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        start_pool(shared.model(), num_workers=0, name="rollout-none")
    with pytest.raises(TypeError, match="num_workers must be an int"):
        start_pool(shared.model(), num_workers="2", name="rollout-none")
    assert client.weights_digest() == model_digest(shared.model())  # nothing was loaded
    assert_same(client.generate(*reqs), reference, "after the rejected calls")


def test_cancel(service):
    client = service
    long = SamplingParams(max_tokens=500, temperature=1.0, seed=5, determinism="invariant")
    short = SamplingParams(max_tokens=4, temperature=0)
    before = client.stats()
    ref, _ = client.submit([[1, 2, 3], [4, 5, 6]], [long, short], request_ids=["long", "short"])
    wait_for(lambda: client.stats()["in_flight"] == 1, what="the long request alone")
    assert client.cancel("long") == 1
    cancelled, done = ray.get(ref, timeout=60)
    assert cancelled.finish_reason == "abort" and len(cancelled.token_ids) < 500
    assert done.ok and len(done.token_ids) == 4

    # cancelling the asyncio task of generate_async aborts the request in its worker
    async def cancel_task():
        task = asyncio.ensure_future(client.generate_async([[7, 8]], long, request_ids=["async-long"]))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(cancel_task())
    wait_for(lambda: client.stats()["aborted"] == before["aborted"] + 2, what="the async abort")
    wait_for(lambda: client.stats()["in_flight"] == 0, what="an idle pool")
    assert client.cancel(["no-such-request"]) == 0


def test_update_weights_digest_restart_and_other_driver(service, reqs):
    client = service
    address = ray.get_runtime_context().gcs_address
    # Another driver finds the pool by name, generates, pushes new weights, and exits: the pool must
    # outlive that driver's ObjectRef when it later restarts a worker.
    script = textwrap.dedent("""
        import json, sys, ray
        ray.init(address=sys.argv[1], log_to_driver=False)
        from rollout_service.tiny_models import tiny_model
        from rollout_service import RolloutClient, SamplingParams
        client = RolloutClient("rollout")
        [r] = client.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=1.0, seed=7))
        digest = client.update_weights(tiny_model("qwen2", seed=2).state_dict())
        print("RESULT", json.dumps({"tokens": r.token_ids, "logprobs": r.logprobs, "digest": digest}))
    """)
    proc = subprocess.run([sys.executable, "-c", script, address], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    other = json.loads(proc.stdout.split("RESULT", 1)[1])
    [mine] = Engine(shared.model(), **ENGINE_KWARGS).generate([[1, 2, 3]],
                                                             SamplingParams(max_tokens=6, temperature=1.0, seed=7))
    assert other["tokens"] == mine.token_ids and other["logprobs"] == mine.logprobs

    new = tiny_model("qwen2", seed=2)
    assert other["digest"] == state_dict_digest(new.state_dict())
    want = Engine(new, **ENGINE_KWARGS).generate(*reqs)
    assert client.weights_digest() == other["digest"]
    assert [ray.get(w.weights_digest.remote()) for w in client.workers()] == [other["digest"]] * 2
    assert_same(client.generate(*reqs), want, "on the new weights")

    # A replacement worker loads the current weights (copied from a live worker: their sender is gone).
    ray.kill(client.workers()[0])
    wait_for(lambda: client.stats()["workers"][0]["restarts"] == 1
             and client.stats()["workers"][0]["state"] == "ready", what="the restart")
    assert ray.get(client.workers()[0].weights_digest.remote()) == other["digest"]
    assert_same(client.generate(*reqs), want, "after the restart")

    # Back to the weights the other tests expect, from this driver.
    sd = shared.model().state_dict()
    assert client.update_weights(sd) == state_dict_digest(sd) == model_digest(shared.model())
    assert [ray.get(w.weights_digest.remote()) for w in client.workers()] == [state_dict_digest(sd)] * 2


def test_tree_width_reaches_the_workers_and_is_checked(service, reqs, tree_width):
    pool = start_pool(shared.model(), num_workers=1, name="rollout-width-2", engine_kwargs=ENGINE_KWARGS,
                       resources_per_worker=with_tree_width({"num_cpus": 1}, 2))
    try:
        assert pool.info["canonical"].tree_segments == 2 != K.tree_segments()
        got = pool.generate(*reqs)
        with pytest.raises(CanonicalMismatchError, match="log-probs would differ"):  # a trainer at the default width
            K.check_canonical({"rollout workers": pool.info["canonical"], "trainer": K.canonical_config("cpu")})
    finally:
        pool.shutdown()
    tree_width(2)
    want = Engine(shared.model(), **ENGINE_KWARGS).generate(*reqs)
    K.check_canonical({"rollout workers": pool.info["canonical"], "trainer": K.canonical_config("cpu")})
    # (this model's K is too short for the width to change its bf16 outputs: tests/test_tp.py shows
    # widths round differently; here the point is that the worker runs the width it was given)
    assert_same(got, want, "a width-2 worker vs a width-2 engine here")


def test_a_checkpoint_path_handed_to_a_worker(service, reqs, reference, tmp_path):
    """The user's path: a checkpoint saved to disk, loaded by the worker itself, and scored by a
    trainer that loads it with from_pretrained(bf16): the same bits as the in-memory model."""
    import transformers

    import trainer_patch
    shared.model().save_pretrained(tmp_path)
    pool = start_pool(str(tmp_path), num_workers=1, name="rollout-from-path", engine_kwargs=ENGINE_KWARGS)
    try:
        got = pool.generate(*reqs)
    finally:
        pool.shutdown()
    assert_same(got, reference, "a worker that loaded the checkpoint path")
    trainer = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for (prompt, params), r in zip(zip(*reqs), got):
        ids = torch.tensor([list(prompt) + r.token_ids])
        want = trainer_patch.token_logprobs(trainer, ids, temperature=params.temperature)[0, -len(r.token_ids):]
        assert want.tolist() == r.logprobs


def test_shutdown_releases_workers(pool1):
    from ray.util import placement_group_table

    workers = pool1.workers()
    def pg_states():
        return [pg["state"] for pg in placement_group_table().values()]
    assert "CREATED" in pg_states()
    pool1.shutdown()
    for w in workers:
        with pytest.raises(RayActorError):
            ray.get(w.load.remote(), timeout=60)
    with pytest.raises(ValueError, match="no rollout pool"):
        RolloutClient("rollout-1")
    with pytest.raises(RayActorError):
        pool1.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0))
    wait_for(lambda: "CREATED" not in pg_states(), what="the placement group's removal")
