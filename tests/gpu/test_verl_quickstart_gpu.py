"""verl's GSM8K GRPO quick start (FSDP2 actor, vLLM rollout, one GPU) with the zero-KL integration on and off:
on, verl logs training/rollout_probs_diff_max == 0.0 at every step; off, it is > 0 at every step.

The machine has no network: the model is a tiny random Qwen2 with a byte-level tokenizer (its embedding padded
past the tokenizer, as Qwen2.5's is, so verl's vLLM-only vocabulary mask is exercised), and GSM8K comes from
the shared data folder, converted to parquet the way verl's examples/data_preprocess/gsm8k.py converts it. A
random model never gives GSM8K's answer, so the reward is the response's share of digits (verl_digit_reward.py):
the actor is updated at every step, and each later rollout runs on the weights verl pushed after that update.
Run with `pytest -m gpu tests/gpu/test_verl_quickstart_gpu.py` with this package installed (its entry points:
vLLM's engine core finds the canonical model through one) and verl with its dependencies (offline:
scripts/verl_gpu_wheels.sh, vLLM's OpenAI server included); ZEROKL_GSM8K names the folder holding
train.jsonl / test.jsonl (default: ../shared/data/gsm8k next to the checkout)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

verl = pytest.importorskip("verl", reason="the verl extra")

from bench.verl_grpo import (DIFF_KEY, SHAPES, byte_level_checkpoint, gsm8k_parquet, run_verl,  # noqa: E402
                             verl_overrides)
from rollout_service.integrations.verl import LIB  # noqa: E402
import verl_capture  # noqa: E402
from verl_shared import digit_reward_overrides, gsm8k_folder  # noqa: E402

STEPS = 3


def quickstart(model: str, data: dict[str, str], root: Path, zerokl: bool) -> list[float]:
    """verl's PPO main with the quick start's GRPO settings (bench.verl_grpo's tiny shape) for STEPS steps, old
    log-probs recomputed (no bypass mode), rewarded by verl_digit_reward so that the actor is updated at every
    step (its gradient norm is checked > 0); each step's training/rollout_probs_diff_max."""
    name = "on" if zerokl else "off"
    overrides = verl_overrides(SHAPES["tiny"], model, data, STEPS, "verl", name)
    overrides += digit_reward_overrides()
    if zerokl:  # the integration alone: verl still recomputes the old log-probs and logs their difference
        overrides.append(f"actor_rollout_ref.model.external_lib={LIB}")
    by_step = run_verl(overrides, root / f"{name}.jsonl", root / f"{name}.log", timeout_s=1800)
    diffs = {step: m[DIFF_KEY] for step, m in by_step.items() if DIFF_KEY in m}
    assert sorted(diffs) == list(range(1, STEPS + 1)), f"each step logs the difference: {diffs}"
    updates = [by_step[s].get("actor/grad_norm", 0.0) for s in sorted(by_step)]
    assert all(g > 0.0 for g in updates), f"the actor is updated at every step (gradient norms {updates})"
    return [diffs[s] for s in sorted(diffs)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("the verl quick start needs a CUDA GPU")
    root = tmp_path_factory.mktemp("verl_quickstart")
    model = byte_level_checkpoint(root / "model", SHAPES["tiny"].model)
    data = gsm8k_parquet(gsm8k_folder(), root, {"train": 64, "test": 8})
    return root, model, data


def test_quickstart_logs_zero_difference_at_every_step(setup, monkeypatch):
    """The user's path: verl loads nothing of ours but the integration. For a failure's token-by-token account,
    set ZEROKL_VERL_CAPTURE to an empty folder: verl's workers then also load verl_capture.py, which records each
    scored micro-batch next to the rollout's log-probs (an import in every verl process, so not the default)."""
    root, model, data = setup
    captures = os.environ.get(verl_capture.ENV)
    if captures:
        monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "verl_capture")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent),
                                                          os.environ.get("PYTHONPATH", "")]))
    diffs = quickstart(model, data, root, zerokl=True)
    assert diffs == [0.0] * STEPS, (diffs, verl_capture.compare(Path(captures)) if captures else
                                    f"set {verl_capture.ENV} to a folder for a token-by-token account")


def test_quickstart_without_the_integration_differs_at_every_step(setup):
    root, model, data = setup
    diffs = quickstart(model, data, root, zerokl=False)
    assert all(d > 0.0 for d in diffs), diffs
