"""The tiny tool task (recipes/tiny_tools.py) and its recipe (tiny_tools.yaml): the calculator environment on
token ids, and multi-turn GRPO with KL and max |Δ log-prob| exactly 0.0 over the model's tokens of every turn,
observations out of the loss; the `off` control shows a mismatch."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from recipes.environment import Environment, EpisodeEnd
from recipes.tiny_tools import CalculatorEnv, build_tokenizer, solution

TINY_TOOLS = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "tiny_tools.yaml"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_the_calculator_answers_calls_and_scores_the_answer(tok):
    env = CalculatorEnv(tok)
    assert isinstance(env, Environment)
    prompt = env.reset({"prompt_ids": _ids(tok, "3+14+5="), "answer": "22"})
    assert tok.decode(prompt) == "3+14+5="
    first = env.step(_ids(tok, "c(3+14)"))
    assert tok.decode(first.observation) == "=17" and not first.done and first.reward == 0.0
    assert env.step(_ids(tok, "22") + [tok.eos_token_id]).reward == 1.0
    wrong = env.step(_ids(tok, "21") + [tok.eos_token_id])
    assert wrong.done and wrong.reward == 0.0
    assert "".join(solution([3, 14, 5])) == "c(3+14)=17c(17+5)=2222"


@pytest.mark.parametrize("turn, reason", [("c(3+)", "malformed tool call: 'c(3+)'"), ("(3+4)", "malformed tool call"),
                                          ("w(3+4)", "unknown tool 'w'")])
def test_bad_calls_end_the_episode_with_a_reason(tok, turn, reason):
    env = CalculatorEnv(tok)
    env.reset({"prompt_ids": _ids(tok, "1+2+3="), "answer": "6"})
    with pytest.raises(EpisodeEnd, match=re.escape(reason)):
        env.step(_ids(tok, turn))


@pytest.mark.slow  # the recipe on a local Ray cluster
def test_the_tool_recipe_has_exactly_zero_kl_over_the_models_tokens(local_ray, tmp_path):
    from recipes.config import load_config
    from recipes.grpo import run
    from recipes.metrics import read_metrics
    run(load_config(TINY_TOOLS, ["train.steps=3", "train.prompts_per_step=8", "metrics.wandb=false",
                                 "train.save_rollouts=true", "train.save_every=0", f"run_dir={tmp_path}"]), progress=False)
    logged = read_metrics(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3]
    for rec in logged:
        assert rec["rollout_train/kl"] == 0.0 and rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        lines = [json.loads(x) for x in (tmp_path / "rollouts" / f"step_{rec['step']:06d}.jsonl").read_text().splitlines()]
        # the KL covers the model's tokens alone; an observation's log-prob slot is 0.0
        masks = [line["model_mask"] for line in lines]
        assert rec["rollout_train/tokens"] == sum(map(sum, masks)) < sum(len(line["tokens"]) for line in lines)
        assert all(lp == 0.0 for line in lines for lp, m in zip(line["logprobs"], line["model_mask"]) if not m)
        assert all(line["end"] and line["turns"] >= 1 for line in lines)
        assert rec["episode/turns_mean"] == sum(line["turns"] for line in lines) / len(lines) >= 1.0
        ends = rec["episode/done_fraction"] + rec["episode/max_turns_fraction"] + rec["episode/error_fraction"]
        assert ends == pytest.approx(1.0)


@pytest.mark.slow
def test_the_unprotected_tool_recipe_mismatches(local_ray, tmp_path):
    from recipes.config import load_config
    from recipes.grpo import run
    from recipes.metrics import read_metrics
    run(load_config(TINY_TOOLS, ["train.steps=2", "train.prompts_per_step=8", "metrics.wandb=false",
                                 "train.save_every=0", "rollout.determinism=off", f"run_dir={tmp_path}"]),
        progress=False)
    assert all(r["rollout_train/max_abs_logprob_diff"] > 0.0 for r in read_metrics(tmp_path))
