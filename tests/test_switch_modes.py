"""A pool's weight-push modes (rollout_service/service/switch_modes.py), through start_pool and the
client, with both policies checkpoints on disk:

- switch-in-flight: running requests continue on the new weights from their next token; each token's
  log-prob is the trainer's under the version it is stamped with, over the whole prefix (control: the
  latest weights alone differ); with a cancel and a worker killed mid-push, no request is lost or
  duplicated.
- finish-then-switch: running requests finish on their version, and a worker that holds none switches
  at once and serves new requests on the new weights while another still finishes its long one.
- two pushes sent at once, one in each mode, while requests keep coming: none is lost, duplicated or
  mixed beyond what its stamps say.
- bad pushes (a wrong digest, an unknown mode, a bucketed transport) are refused and the pool keeps
  serving the weights it had.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import trainer_patch
from rollout_service import SamplingParams, WeightMismatchError
from rollout_service.weights import state_dict_digest
from rollout_service.engine.engine import Engine
from rollout_service.engine.tp.engine import TPEngine
from rollout_service.service.switch_modes import SWITCH_MODES, engine_switch_modes

ray = pytest.importorskip("ray")
from rollout_service import start_pool  # noqa: E402

TEMPERATURE = 1.0
LONG = 360  # tokens: a request still running when the push lands


@pytest.fixture(scope="module")
def policies(policy_checkpoints):
    """(path, trainer model, state dict) of three policies: checkpoints on disk, loaded the usual way."""
    out = []
    for path in policy_checkpoints:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        out.append((path, model, model.state_dict()))
    return out


@pytest.fixture(scope="module")
def pool(local_ray, policies):
    client = start_pool(str(policies[0][0]), num_workers=2, name="rollout-switch-modes",
                        engine_kwargs=dict(window=4, group=8))
    yield client
    client.shutdown()


def _on_old(pool, policies) -> int:
    """The old policy back on every worker (a drain push); returns its version."""
    pool.update_weights(policies[0][2])
    return pool.stats()["weight_version"]


def _requests(n: int, max_tokens: int, first_seed: int):
    prompts = [[3 + i, 17, 40 + 5 * i] for i in range(n)]
    return prompts, [SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE, seed=first_seed + i)
                     for i in range(n)]


def _trainer_logprobs(model, rollout) -> list[float]:
    ids = torch.tensor([rollout.prompt_token_ids + rollout.token_ids])
    return trainer_patch.token_logprobs(model, ids, temperature=TEMPERATURE)[0, -len(rollout.token_ids):].tolist()


def _check_tokens(rollout, models_by_version: dict) -> int:
    """Every token's log-prob is the trainer's under its stamped version; returns the index of the first
    token of the last version (0 when the rollout has one version)."""
    versions = rollout.weight_versions
    assert len(versions) == len(rollout.token_ids) and versions == sorted(versions)
    assert set(versions) <= set(models_by_version), versions
    expected = [None] * len(versions)
    for version in set(versions):
        under = _trainer_logprobs(models_by_version[version], rollout)
        for i, v in enumerate(versions):
            if v == version:
                expected[i] = under[i]
    assert rollout.logprobs == expected  # bit for bit, each token under its own version
    return versions.index(versions[-1])


def _wait_until_running(pool, n: int, settle_s: float = 0.3):
    deadline = time.monotonic() + 60
    while pool.stats()["in_flight"] < n:
        assert time.monotonic() < deadline, "requests never started"
        time.sleep(0.02)
    time.sleep(settle_s)  # past admission and prefill: tokens are being generated


def _wait_all_ready(pool):
    deadline = time.monotonic() + 120
    while any(w["state"] != "ready" for w in pool.stats()["workers"]):  # a killed worker is back
        assert time.monotonic() < deadline, pool.stats()["workers"]
        time.sleep(0.05)


def test_engines_declare_the_modes_they_can_serve():
    assert engine_switch_modes(object.__new__(Engine)) == SWITCH_MODES
    # a tensor-parallel engine keeps its requests' KV across a load: never in flight
    assert engine_switch_modes(object.__new__(TPEngine)) == ("drain", "finish-then-switch")


def test_switch_in_flight_tokens_are_the_trainers_under_their_version(pool, policies):
    old_version = _on_old(pool, policies)
    new_version = old_version + 1
    models = {old_version: policies[0][1], new_version: policies[1][1]}
    prompts, params = _requests(8, LONG, first_seed=500)
    ref, keys = pool.submit(prompts, params)
    _wait_until_running(pool, 8)
    pool.cancel(keys[:1])
    assert pool.update_weights(policies[1][2], mode="switch-in-flight")
    assert pool.stats()["weight_version"] == new_version
    ray.kill(pool.workers()[1])  # its requests run again elsewhere, from their first token
    rollouts = ray.get(ref, timeout=600)
    later = pool.generate(*_requests(4, 12, first_seed=700))

    assert rollouts[0].finish_reason == "abort"
    spanning = 0
    for r in rollouts[1:]:
        assert r.ok and len(r.token_ids) == LONG
        switch = _check_tokens(r, models)
        if 0 < switch:
            spanning += 1
            assert r.logprobs[:switch] != _trainer_logprobs(models[new_version], r)[:switch]  # control
    assert spanning > 0, [r.weight_versions[:1] + r.weight_versions[-1:] for r in rollouts[1:]]
    for r in later:  # started after the push: the new weights only
        assert r.ok and set(r.weight_versions) == {new_version}
        _check_tokens(r, models)
    stats = pool.stats()
    assert stats["submitted"] == stats["completed"] + stats["aborted"] + stats["errors"] and stats["errors"] == 0


def test_finish_then_switch_finishes_old_requests_and_serves_new_ones_at_once(pool, policies):
    old_version = _on_old(pool, policies)
    new_version = old_version + 1
    models = {old_version: policies[0][1], new_version: policies[1][1]}
    _wait_all_ready(pool)
    # one long request holds one worker; the other worker is idle
    ref, _ = pool.submit(*_requests(1, LONG, first_seed=800))
    _wait_until_running(pool, 1)
    pushed = threading.Event()
    pusher = threading.Thread(target=lambda: (pool.update_weights(policies[1][2], mode="finish-then-switch"),
                                              pushed.set()))
    pusher.start()
    time.sleep(0.2)
    short = pool.generate(*_requests(4, 8, first_seed=900), timeout=300)
    served_during_push = not pushed.is_set()
    pusher.join(timeout=600)
    [long] = ray.get(ref, timeout=600)

    assert long.ok and set(long.weight_versions) == {old_version}  # finished on its version
    _check_tokens(long, models)
    for r in short:  # started after the push began: the new weights, on the worker that switched
        assert r.ok and set(r.weight_versions) == {new_version}
        _check_tokens(r, models)
    assert served_during_push, "new requests waited for the long one, as a drain push makes them"
    assert pool.stats()["weight_version"] == new_version


@pytest.mark.parametrize("mode", ["finish-then-switch", "switch-in-flight"])
def test_refused_pushes_keep_the_old_weights(pool, policies, mode):
    old_version = _on_old(pool, policies)
    digest = pool.weights_digest()
    prompts, params = _requests(2, 10, first_seed=40)
    before = pool.generate(prompts, params)
    with pytest.raises(WeightMismatchError):
        pool.update_weights(policies[1][2], expected_digest="0" * 16, mode=mode)
    with pytest.raises(ValueError, match="buckets"):
        pool.update_weights(policies[1][2], transport="broadcast", mode=mode)
    with pytest.raises(ValueError, match="mode must be one of"):
        pool.update_weights(policies[1][2], mode="eventually")
    assert pool.weights_digest() == digest and pool.stats()["weight_version"] == old_version
    after = pool.generate(prompts, params)
    assert [r.logprobs for r in after] == [r.logprobs for r in before]
    assert all(set(r.weight_versions) == {old_version} for r in after)


def test_concurrent_pushes_in_both_modes_lose_and_mix_nothing(pool, policies):
    """Waves of requests while two pushes, one switch-in-flight and one finish-then-switch, are sent at once
    from two threads: the pool takes them one after the other, every request comes back once, and each token
    is the trainer's under the version it is stamped with."""
    base = _on_old(pool, policies)
    _wait_all_ready(pool)
    got, errors = {}, []

    def waves():
        for w in range(4):
            for i, r in enumerate(pool.generate(*_requests(8, 40, first_seed=2000 + 8 * w), timeout=600)):
                assert 8 * w + i not in got
                got[8 * w + i] = r

    def push(state_dict, mode):
        try:
            pool.update_weights(state_dict, mode=mode)
        except Exception as e:  # reported below: a thread's exception would be lost
            errors.append(e)

    sender = threading.Thread(target=waves)
    sender.start()
    _wait_until_running(pool, 8, settle_s=0.1)
    pushers = [threading.Thread(target=push, args=(policies[1][2], "switch-in-flight")),
               threading.Thread(target=push, args=(policies[2][2], "finish-then-switch"))]
    for t in pushers:
        t.start()
    for t in pushers + [sender]:
        t.join(timeout=600)
    assert not errors and pool.stats()["weight_version"] == base + 2
    last = [state_dict_digest(p[2]) for p in policies].index(pool.weights_digest())  # the push taken second
    assert last in (1, 2)
    models = {base: policies[0][1], base + 1: policies[3 - last][1], base + 2: policies[last][1]}
    assert sorted(got) == list(range(32))
    seen = set()
    for r in got.values():
        assert r.ok and len(r.token_ids) == 40
        _check_tokens(r, models)
        seen |= set(r.weight_versions)
    assert {base, base + 2} <= seen
