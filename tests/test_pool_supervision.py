"""What an operator meets first: start_pool returns or raises in bounded time with the cause at the
call, a worker killed again and again comes back and serves the same bits, errors keep their own type
and message, and one rule for bad requests and sampling values everywhere."""
from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

import service_shared as shared  # noqa: E402
from service_shared import ENGINE_KWARGS, assert_same  # noqa: E402

from rollout_service import Engine, InvalidRequestError, SamplingParams, start_pool  # noqa: E402
from rollout_service.params import check_sampling  # noqa: E402


@pytest.fixture(scope="module")
def cluster(request):
    shared.cluster()
    yield
    shared.release(request, "cluster")


def test_unplaceable_workers_raise_in_bounded_time_naming_the_resources(cluster):
    t = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        start_pool(shared.model(), num_workers=1, name="rollout-unplaceable", resources_per_worker={"num_cpus": 64},
                   start_timeout_s=5)
    assert time.monotonic() - t < 30
    message = str(info.value)
    assert "'CPU': 64" in message and "free" in message and "start_timeout_s" in message, message
    with pytest.raises(ValueError):
        ray.get_actor("rollout-unplaceable", namespace="rollout_service")  # nothing left behind
    with pytest.raises(ValueError, match="start_timeout_s"):
        start_pool(shared.model(), num_workers=1, name="rollout-unplaceable", start_timeout_s=0)


def test_a_pool_actor_slower_than_the_timeout_is_said_in_our_words(cluster):
    """A busy cluster can be slower to start the pool's own actor than start_timeout_s: the TimeoutError says so,
    with what each worker asks for and what the cluster has free (not Ray's bare "Get timed out")."""
    with pytest.raises(TimeoutError, match="pool's own actor was not ready") as info:
        start_pool(shared.model(), num_workers=1, name="rollout-slow-actor", start_timeout_s=1e-3)
    assert "'CPU': 1" in str(info.value) and "free" in str(info.value) and "start_timeout_s" in str(info.value)
    with pytest.raises(ValueError):
        ray.get_actor("rollout-slow-actor", namespace="rollout_service")  # nothing left behind


def test_a_worker_that_cannot_start_raises_its_own_error(cluster):
    t = time.monotonic()
    with pytest.raises(TypeError, match="unknown engine options") as info:
        start_pool(shared.model(), num_workers=1, name="rollout-bad-option", engine_kwargs={"no_such_option": 1})
    assert time.monotonic() - t < 60
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    assert info.value.__cause__ is not None  # Ray's error, with the remote traceback, is kept there


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_worker_killed_five_times_in_a_row_comes_back_and_serves_the_same_bits(cluster):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in range(3)]
    want = Engine(shared.model(), **ENGINE_KWARGS).generate(prompts, params)
    pool = start_pool(shared.model(), num_workers=2, name="rollout-kill5", engine_kwargs=ENGINE_KWARGS)
    try:
        kills, victim = 0, None
        deadline = time.monotonic() + 60
        while kills < 5:  # kill each replacement as soon as it exists, usually while it is starting
            assert time.monotonic() < deadline, pool.stats()
            actor = pool.workers()[0]
            if actor != victim:
                ray.kill(actor)
                victim, kills = actor, kills + 1
            time.sleep(0.05)
        _wait(lambda: pool.stats()["workers"][0]["state"] == "ready", pool)
        stats = pool.stats()["workers"][0]
        assert stats["restarts"] >= 1 and stats["failed_restarts"] == 0 and stats["error"] is None, stats
        assert_same(pool.generate(prompts, params), want, "after five kills")
        assert_same(pool.generate(prompts * 4, params * 4), want * 4, "on both workers")
    finally:
        pool.shutdown()


def _wait(cond, pool, timeout=180.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, pool.stats()
        time.sleep(0.1)


def test_max_tokens_beyond_the_models_positions_is_refused_not_cut():
    """600 tokens asked of a 512-position model: an error that says so, as vLLM's server gives, not
    509 tokens with finish_reason "length"."""
    engine = Engine(shared.model(), **ENGINE_KWARGS)
    too_long = SamplingParams(max_tokens=600, temperature=0)
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len 512"):
        engine.add_request([1, 2, 3], too_long)
    [r] = engine.generate([[1, 2, 3]], too_long)
    assert not r.ok and r.finish_reason == "error" and "max_model_len" in r.error
    [fits] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=509, temperature=0))
    assert fits.ok and len(fits.token_ids) == 509


def test_the_error_contract_of_a_batch_call():
    engine = Engine(shared.model(), **ENGINE_KWARGS)
    good = SamplingParams(max_tokens=4, temperature=0)
    for prompts, params, error in ((5, good, TypeError), ([1, 2, 3], good, TypeError),
                                   ([[1, 2]], {"max_tokens": 4}, TypeError), ([[1], [2]], [good] * 3, ValueError)):
        with pytest.raises(error):
            engine.generate(prompts, params)
    out = engine.generate([[1, 2], [], [500], [3, 4]], good)  # per request: served or an error rollout
    assert [r.ok for r in out] == [True, False, False, True]
    assert "empty" in out[1].error and "outside" in out[2].error


def test_one_rule_for_sampling_values():
    from rollout_service.vllm.plugin.sampling import request_params
    pytest.importorskip("vllm")
    from vllm import SamplingParams as VSamplingParams

    assert SamplingParams(max_tokens=1, top_k=0, temperature=0).top_k == -1  # off, as vLLM takes it
    assert SamplingParams(max_tokens=1, top_k=-1, temperature=0).top_k == -1
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(max_tokens=1, top_k=-5, temperature=0)
    # the vLLM plugin's params (the server's zerokl_* fields) follow the same function
    off = request_params(VSamplingParams(temperature=0, extra_args={"zerokl": {"temperature": 0, "top_k": 0}}))
    assert off["top_k"] == -1
    with pytest.raises(ValueError, match="top_k"):
        request_params(VSamplingParams(temperature=0, extra_args={"zerokl": {"temperature": 0, "top_k": -5}}))
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(seed=-1), dict(seed=2 ** 63)):
        values = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": 1, **bad}
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            check_sampling(**values)
        with pytest.raises(InvalidRequestError):
            SamplingParams(max_tokens=1, **values)
        with pytest.raises(ValueError, match=next(iter(bad))):
            request_params(VSamplingParams(temperature=0, extra_args={"zerokl": values}))
