"""Multi-turn episodes through a rollout pool of native workers (recipes.episodes.run_episodes with the pool
client's generate; a tiny model saved to disk). Whichever worker each turn lands on, and with a worker killed
between two turns or while a turn runs, every episode is bit for bit the one all of whose turns ran on one
worker, and each model token's log-prob is the trainer's from one forward over the whole trajectory. The
control, determinism off, matches neither the trainer nor itself run the other way."""
from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

import pool_episodes_shared as ep_shared  # noqa: E402
import service_shared as shared  # noqa: E402
from pool_episodes_shared import (OneAtATime, Recorded, assert_same_episodes, episode_bits, run,  # noqa: E402
                                  trainer_mismatches)
from service_shared import ENGINE_KWARGS  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import rollout_service  # noqa: E402
from rollout_service import start_pool  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402

TURNS = 3
MAX_TOKENS = 16  # long enough for a turn to be in flight when a worker is killed during it
ROWS = ep_shared.rows(5, seed=5, lo=3, hi=12)  # odd: sent one at a time, an episode's turns alternate workers


@ray.remote
def _module_file() -> str:
    return rollout_service.__file__


@pytest.fixture(scope="module")
def cluster(request):
    shared.cluster()
    # the workers must run this checkout's code, as the driver does (Ray puts the driver's directory first)
    assert ray.get(_module_file.remote()) == rollout_service.__file__
    yield
    shared.release(request, "cluster")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool-episodes-model")
    tiny_model("qwen2", seed=11).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def trainer(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def one_worker(cluster, checkpoint):
    """The episodes with every turn on one worker, each turn's requests in one batch; and determinism off."""
    pool = start_pool(checkpoint, num_workers=1, name="episodes-one-worker", engine_kwargs=ENGINE_KWARGS)
    try:
        return {"verified": run(pool.generate, ROWS, TURNS, MAX_TOKENS),
                "off": run(pool.generate, ROWS, TURNS, MAX_TOKENS, determinism="off")}
    finally:
        pool.shutdown()


@pytest.fixture(scope="module")
def two_workers(cluster, checkpoint):
    pool = start_pool(checkpoint, num_workers=2, name="episodes-two-workers", engine_kwargs=ENGINE_KWARGS)
    yield pool
    pool.shutdown()


def test_every_model_token_is_the_trainers_and_off_is_not(one_worker, trainer):
    assert [trainer_mismatches(trainer, ep) for ep in one_worker["verified"]] == [0] * len(ROWS)
    assert sum(trainer_mismatches(trainer, ep) for ep in one_worker["off"]) > 0, \
        "determinism off matched the trainer: the control cannot fail"


def test_turns_on_different_workers_are_the_one_workers_bits(two_workers, one_worker):
    ep_shared.wait_ready(two_workers)
    router = OneAtATime(two_workers)
    apart = run(router, ROWS, TURNS, MAX_TOKENS)
    # the claim needs it to have happened: every episode had turns on both workers
    assert all(set(router.served[e]) == {0, 1} for e in range(len(ROWS))), router.served
    assert_same_episodes(apart, one_worker["verified"], "turns on different workers, one request at a time")
    batched = run(two_workers.generate, ROWS, TURNS, MAX_TOKENS)  # each turn's batch split over two workers
    assert_same_episodes(batched, one_worker["verified"], "each turn's batch over two workers")
    assert two_workers.stats()["prefix_cache"] is None  # native workers have no prefix cache to report
    # the control: determinism off, the same two runs (one at a time over two workers, batched on one) differ
    off_apart = run(OneAtATime(two_workers), ROWS, TURNS, MAX_TOKENS, determinism="off")
    assert any(episode_bits(a) != episode_bits(b) for a, b in zip(off_apart, one_worker["off"])), \
        "determinism off gave the same bits: the control cannot fail"


def test_a_worker_killed_between_turns(two_workers, one_worker):
    ep_shared.wait_ready(two_workers)
    victim = two_workers.workers()[0]
    restarts = two_workers.stats()["workers"][0]["restarts"]

    def kill_before_second_turn(turn: int) -> None:
        if turn == 1:
            ray.kill(victim)
    episodes = run(Recorded(two_workers.generate, kill_before_second_turn), ROWS, TURNS, MAX_TOKENS)
    assert_same_episodes(episodes, one_worker["verified"], "a worker killed between turns")
    ep_shared.wait_ready(two_workers)  # the slot is served by a replacement
    assert two_workers.workers()[0] != victim
    assert two_workers.stats()["workers"][0]["restarts"] > restarts


def test_a_worker_killed_during_a_turn(two_workers, one_worker):
    episodes = ep_shared.run_with_a_worker_killed_during_a_turn(two_workers, ROWS, TURNS, MAX_TOKENS)
    assert_same_episodes(episodes, one_worker["verified"], "a worker killed during a turn")
