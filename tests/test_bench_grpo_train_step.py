"""bench.grpo_train_step runs both arms of the recipe's train step on CPU (the tiny shape), each on the same
batch packed and padded in turns, and prints its JSON: per arm, round and layout the step's seconds and
tokens/s, the packed / padded and stock / canonical ratios, and a profiled step's tables."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.grpo_train_step import batch, layout_shape, mfu, samples
from recipes.rollouts import completion_budget

REPO = Path(__file__).resolve().parents[1]
TINY_VOCAB = 96  # bench.rollout's tiny shape
LOGNORMAL = {"lengths": "lognormal", "median": 24, "sigma": 0.8, "cap": 64}


def _bench(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.grpo_train_step", "--model", "tiny", "--device", "cpu", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_grpo_train_step_cpu_both_layouts_variable_lengths(tmp_path):
    proc = _bench(["--prompts", "4", "--group", "4", "--warmup", "1", "--steps", "2", "--lengths", "lognormal",
                   "--median", "24", "--sigma", "0.8", "--cap", "64", "--max-tokens-per-micro-batch", "160",
                   "--activation-checkpointing", "--profile", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["layouts"] == ["packed", "padded"] and out["arms"] == ["canonical", "stock"]
    assert out["activation_checkpointing"] is True and out["max_tokens_per_micro_batch"] == 160
    drawn = samples(TINY_VOCAB, 4, 4, **LOGNORMAL)
    lengths = [len(s.token_ids) for s in drawn]
    assert out["completion_lengths"]["median"] == statistics.median(lengths) and max(lengths) > 2 * min(lengths)
    real = sum(len(s.prompt_ids) + len(s.token_ids) for s in drawn)
    (row,) = out["rounds"]
    assert row["order"] == ["canonical", "stock"] and row["layouts"] == ["packed", "padded"]
    for arm in ("canonical", "stock"):
        figures = row[arm]
        packed, padded = figures["packed"], figures["padded"]
        for layout in (packed, padded):
            assert len(layout["seconds"]) == 2 and layout["median_s"] > 0
            assert layout["tokens"] == real  # real tokens: no pad counted
            assert layout["tokens_per_s"] == layout["tokens"] / layout["median_s"]
            assert layout["host_self_s"] > 0 and layout["profiled_step_s"] > 0
            assert "peak_memory_gib" not in layout and "mfu" not in layout  # GPU only
        assert packed["micro_batches"] == padded["micro_batches"] > 1  # the budget groups the same rows
        assert packed["pad_fraction"] == 0.0 < padded["pad_fraction"]  # lengths vary: the padded rows hold pad
        assert figures["packed_over_padded_tokens_per_s"] == packed["tokens_per_s"] / padded["tokens_per_s"]
        assert figures["packed_over_padded_per_step"] == [d / p for p, d in zip(packed["seconds"], padded["seconds"])]
        assert out["packed_over_padded_tokens_per_s_median"][arm] == figures["packed_over_padded_tokens_per_s"]
        for layout in ("packed", "padded"):
            assert "aten::" in (tmp_path / f"train_step_{arm}_{layout}.txt").read_text()
    for layout in ("packed", "padded"):
        ratio = row["stock"][layout]["median_s"] / row["canonical"][layout]["median_s"]
        assert row["stock_over_canonical"][layout] == ratio == out["stock_over_canonical_median"][layout]


@pytest.mark.slow
def test_bench_grpo_train_step_one_layout_one_arm_rounds_alternate():
    """One arm, one layout (today's arithmetic lengths): no pairs, so no ratio; two rounds. --empty-cache
    reaches the arm's process (a no-op on CPU) and the JSON says it was on."""
    proc = _bench(["--prompts", "2", "--group", "2", "--warmup", "0", "--steps", "1", "--rounds", "2",
                   "--arms", "canonical", "--layouts", "padded", "--empty-cache"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert [r["order"] for r in out["rounds"]] == [["canonical"], ["canonical"]] and out["empty_cache"] is True
    assert all(set(r["canonical"]) >= {"padded"} and "packed" not in r["canonical"] for r in out["rounds"])
    assert "packed_over_padded_tokens_per_s_median" not in out and "stock_over_canonical_median" not in out
    assert 4 <= out["completion_lengths"]["min"] <= out["completion_lengths"]["max"] <= 16


def test_bench_grpo_train_step_refuses_unknown_layouts_and_a_median_over_the_cap():
    proc = _bench(["--layouts", "packed,ragged"])
    assert proc.returncode == 2 and "--layouts" in proc.stderr
    proc = _bench(["--lengths", "lognormal", "--median", "5000", "--cap", "4096"])
    assert proc.returncode == 2 and "--median" in proc.stderr


def test_bench_lengths_are_the_recipes_draws_and_layouts_share_micro_batches():
    drawn = samples(TINY_VOCAB, 3, 5, **LOGNORMAL)
    assert [len(s.token_ids) for s in drawn] == [completion_budget(0, 1, p, j, "lognormal", 64, 24, 0.8)
                                                 for p in range(3) for j in range(5)]
    assert all(len(s.token_ids) == 64 for s in samples(TINY_VOCAB, 2, 2, lengths="fixed", cap=64))
    assert all(4 <= len(s.token_ids) <= 16 for s in samples(TINY_VOCAB, 4, 4))
    packed, _ = batch(TINY_VOCAB, 3, 5, layout="packed", max_tokens_per_micro_batch=120, **LOGNORMAL)
    padded, tokens = batch(TINY_VOCAB, 3, 5, layout="padded", max_tokens_per_micro_batch=120, **LOGNORMAL)
    assert tokens == [sum(len(s.token_ids) for s in drawn)]
    packed, padded = packed[0][0], padded[0][0]  # rank 0, mini-batch 0: its micro-batches
    assert len(packed) == len(padded) > 1
    for flat, rows in zip(packed, padded):  # the same sequences per forward, one row or right-padded rows
        assert flat["input_ids"].shape[0] == 1 and "position_ids" in flat and "attention_mask" in rows
        assert flat["input_ids"].numel() == int(rows["attention_mask"].sum()) <= 120
        assert rows["input_ids"].shape[1] == int(rows["attention_mask"].sum(1).max())  # padded to the longest
    shape_packed, shape_padded = layout_shape(packed), layout_shape(padded)
    assert shape_packed["tokens"] == shape_padded["tokens"] == sum(len(s.prompt_ids) + len(s.token_ids)
                                                                   for s in drawn)
    assert shape_packed["pad_fraction"] == 0.0 < shape_padded["pad_fraction"]
    assert mfu(10 ** 9, 790e12 / 6e9) == pytest.approx(1.0)  # 6 x params x tokens/s over the H200's peak


def test_bench_padded_rows_are_the_trainer_before_token_budgets():
    """--padded-rows N: the padded layout forms micro-batches of N sequences in batch order, padded to their
    longest, as trainer.batching.micro_batch_size did; the packed layout keeps its token budget."""
    from bench.grpo_train_step import layout_plans, layout_shape, samples

    batch = samples(96, prompts=4, group=4, lengths="lognormal", median=40, sigma=0.7, cap=160)
    plans = layout_plans(batch, ["packed", "padded"], max_tokens_per_micro_batch=400, padded_rows=4)
    padded, packed = layout_shape(plans["padded"][0][0][0]), layout_shape(plans["packed"][0][0][0])
    assert padded["micro_batches"] == 4 and padded["tokens"] == packed["tokens"]
    assert [mb["input_ids"].shape[0] for mb in plans["padded"][0][0][0]] == [4, 4, 4, 4]
    assert padded["pad_fraction"] > 0 and packed["pad_fraction"] == 0
    assert all(mb["input_ids"].numel() <= 400 for mb in plans["packed"][0][0][0])
