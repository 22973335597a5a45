"""bench.verl_grpo on CPU: every shape's overrides compose in verl's own config (hydra, as verl's main composes it)
and the zerokl arm passes the integration's check with bypass mode on; the GSM8K rows become verl's parquet
layout; the byte-level model is narrower in its tokenizer than in its embedding; the arms run in turns and pair
by round. The verl runs themselves need a GPU (tests/gpu/test_verl_quickstart_gpu.py, the bench on one)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("verl", reason="the verl extra (CI installs it)")

import bench.verl_grpo as bench  # noqa: E402
from rollout_service.integrations.verl import check_config, enabled  # noqa: E402
from verl_shared import digit_reward_overrides, verl_config  # noqa: E402

QUESTIONS = [("Tom has 3 apples and buys 4. How many?", "3 + 4 = 7\n#### 7"),
             ("A car costs $1,200 and a bike $300. Total?", "1200 + 300 = 1500\n#### 1,500"),
             ("Half of -8?", "-8 / 2 = -4\n#### -4")]


def gsm8k_folder(tmp_path, rows: int = 3):
    for split in ("train", "test"):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for i in range(rows):
                question, answer = QUESTIONS[i % len(QUESTIONS)]
                f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    return tmp_path


@pytest.mark.parametrize("shape", sorted(bench.SHAPES))
def test_each_shapes_arms_compose_in_verls_config(shape):
    data = {"train": "/data/train.parquet", "test": "/data/test.parquet"}
    configs = {arm: verl_config(*bench.verl_overrides(bench.SHAPES[shape], "/model", data, 4, arm, arm))
               for arm in bench.ARMS}
    zerokl = configs["zerokl"]
    assert enabled(zerokl.actor_rollout_ref.model) and zerokl.algorithm.rollout_correction.bypass_mode is True
    check_config(zerokl)
    for arm in bench.STOCK_ARMS:
        stock = configs[arm]
        assert not enabled(stock.actor_rollout_ref.model) and stock.algorithm.rollout_correction.bypass_mode is False
    s = bench.SHAPES[shape]
    for arm, config in configs.items():  # the same run otherwise
        assert config.data.train_batch_size == s.train_batch_size and config.actor_rollout_ref.rollout.n == s.n
        assert config.data.max_response_length == s.max_response_length
        assert config.actor_rollout_ref.model.use_remove_padding is (arm != "verl-padded")
        assert config.trainer.total_training_steps == 4
    with pytest.raises(ValueError, match="arm 'sglang'"):
        bench.verl_overrides(bench.SHAPES[shape], "/model", data, 4, "sglang", "x")


def test_the_gpu_quick_starts_reward_loads_in_verl_and_varies():
    """The GPU quick start's reward (digit_reward_overrides) composes in verl's config and verl's own loader finds
    it; it tells random responses apart, so GRPO's advantages are not all 0."""
    from verl.trainer.ppo.reward import get_custom_reward_fn
    config = verl_config(*bench.verl_overrides(bench.SHAPES["tiny"], "/model", {"train": "t", "test": "v"}, 3, "verl",
                                               "on"), *digit_reward_overrides())
    score = get_custom_reward_fn(config)
    assert score is not None
    scores = [score(data_source="openai/gsm8k", solution_str=text, ground_truth="7") for text in ("a7b", "xyz", "12")]
    assert scores == [1 / 3, 0.0, 1.0]


def test_gsm8k_rows_become_verls_parquet_layout(tmp_path):
    import datasets
    paths = bench.gsm8k_parquet(gsm8k_folder(tmp_path), tmp_path, {"train": 3, "test": 2})
    train = datasets.Dataset.from_parquet(paths["train"])
    assert len(train) == 3 and len(datasets.Dataset.from_parquet(paths["test"])) == 2
    assert [row["reward_model"]["ground_truth"] for row in train] == ["7", "1500", "-4"]
    assert train[0]["prompt"][0]["role"] == "user" and bench.INSTRUCTION in train[0]["prompt"][0]["content"]
    assert set(train["data_source"]) == {"openai/gsm8k"}
    with pytest.raises(ValueError, match="has 3 rows, 5 asked for"):
        bench.gsm8k_parquet(tmp_path, tmp_path, {"train": 5})


def test_the_byte_level_model_has_more_ids_than_its_tokenizer(tmp_path):
    from transformers import AutoConfig, AutoTokenizer
    path = bench.byte_level_checkpoint(tmp_path / "model", bench.SHAPES["tiny"].model)
    tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    text = "Tom has 3 apples. ünïcode"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer) == 259 < config.vocab_size == 320
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="must exceed"):
        bench.byte_level_checkpoint(tmp_path / "narrow", dict(bench.SHAPES["tiny"].model, vocab_size=200))


def test_arms_run_in_turns_and_pair_by_round(tmp_path, monkeypatch, capsys):
    """main with verl's process replaced by its file logger's lines: round 1 reverses the order, the step is
    the median after the first, the ratio is verl's over zerokl's per round."""
    ran = []

    def fake_run(overrides, log, output, timeout_s=3600):
        arm = "zerokl" if any(o.startswith("actor_rollout_ref.model.external_lib=") for o in overrides) else "verl"
        ran.append(arm)
        seconds = {"verl": [30.0, 12.0, 10.0, 11.0], "zerokl": [25.0, 8.0, 9.0, 10.0]}[arm]
        log.write_text("".join(json.dumps({"step": i + 1, "data": {"timing_s/step": s, "timing_s/gen": s / 2,
                                                                    **({bench.DIFF_KEY: 0.1} if arm == "verl"
                                                                       else {})}}) + "\n"
                               for i, s in enumerate(seconds)))
        return bench.step_metrics(log)
    monkeypatch.setattr(bench, "run_verl", fake_run)
    out = tmp_path / "out.json"
    bench.main(["--shape", "tiny", "--steps", "4", "--rounds", "2", "--gsm8k", str(gsm8k_folder(tmp_path, 40)),
                "--workdir", str(tmp_path / "work"), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == doc
    assert ran == ["verl", "zerokl", "zerokl", "verl"]
    assert [r["order"] for r in doc["rounds"]] == [["verl", "zerokl"], ["zerokl", "verl"]]
    row = doc["rounds"][0]
    assert row["verl"]["step_s"] == 11.0 and row["zerokl"]["step_s"] == 9.0
    assert row["verl"]["timing_s"]["gen"] == [15.0, 6.0, 5.0, 5.5]
    assert row["verl"]["rollout_probs_diff_max"] == [0.1] * 4 and row["zerokl"]["rollout_probs_diff_max"] == [None] * 4
    assert doc["verl_over_zerokl_step"] == [11.0 / 9.0] * 2 and doc["verl_over_zerokl_step_median"] == 11.0 / 9.0


def test_a_comparison_runs_in_pieces_and_goes_on_where_it_stopped(tmp_path, monkeypatch, capsys):
    """--runs 1 per call: each call runs the next arm in turn order and writes the document; the last one is
    complete and pairs the rounds; a document of other settings is not continued."""
    ran = []

    def fake_run(overrides, log, output, timeout_s=3600):
        arm = "zerokl" if any(o.startswith("actor_rollout_ref.model.external_lib=") for o in overrides) else "verl"
        ran.append(arm)
        seconds = {"verl": [30.0, 12.0], "zerokl": [25.0, 8.0]}[arm]
        log.write_text("".join(json.dumps({"step": i + 1, "data": {"timing_s/step": s}}) + "\n"
                               for i, s in enumerate(seconds)))
        return bench.step_metrics(log)
    monkeypatch.setattr(bench, "run_verl", fake_run)
    out = tmp_path / "out.json"
    args = ["--shape", "tiny", "--steps", "2", "--rounds", "2", "--gsm8k", str(gsm8k_folder(tmp_path, 40)),
            "--workdir", str(tmp_path / "work"), "--out", str(out), "--runs", "1"]
    for call in range(4):
        bench.main(args)
        doc = json.loads(out.read_text())
        assert ran == ["verl", "zerokl", "zerokl", "verl"][:call + 1]
        assert doc["complete"] == (call == 3)
    capsys.readouterr()
    assert doc["verl_over_zerokl_step"] == [12.0 / 8.0] * 2
    bench.main(args)  # complete: nothing more runs
    assert len(ran) == 4
    with pytest.raises(SystemExit, match="other settings"):
        bench.main([a if a != "2" else "3" for a in args])


def test_the_padded_stock_arm_and_fewer_prompts(tmp_path, monkeypatch, capsys):
    """--arms verl-padded,zerokl: verl without remove-padding is paired with zerokl under its own key; --prompts
    sets the prompts a step (and caps the mini-batch) in what verl is given and what the document says."""
    seen = {}

    def fake_run(overrides, log, output, timeout_s=3600):
        keys = dict(o.split("=", 1) for o in overrides)
        arm = "zerokl" if "actor_rollout_ref.model.external_lib" in keys else "verl"
        seen[arm] = keys
        seconds = {"verl": [30.0, 15.0], "zerokl": [25.0, 10.0]}[arm]
        log.write_text("".join(json.dumps({"step": i + 1, "data": {"timing_s/step": s}}) + "\n"
                               for i, s in enumerate(seconds)))
        return bench.step_metrics(log)
    monkeypatch.setattr(bench, "run_verl", fake_run)
    bench.main(["--shape", "tiny", "--steps", "2", "--rounds", "1", "--arms", "verl-padded,zerokl", "--prompts", "2",
                "--gsm8k", str(gsm8k_folder(tmp_path, 40)), "--workdir", str(tmp_path / "work")])
    doc = json.loads(capsys.readouterr().out)
    assert seen["verl"]["actor_rollout_ref.model.use_remove_padding"] == "False"
    assert seen["zerokl"]["actor_rollout_ref.model.use_remove_padding"] == "True"
    assert all(keys["data.train_batch_size"] == "2" and keys["actor_rollout_ref.actor.ppo_mini_batch_size"] == "2"
               for keys in seen.values())
    assert doc["settings"]["train_batch_size"] == 2
    assert doc["verl_padded_over_zerokl_step"] == [1.5] and doc["verl_over_zerokl_step"] == []


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--arms", "verl,verl", "--gsm8k", str(gsm8k_folder(tmp_path))])
    with pytest.raises(SystemExit):
        bench.main(["--gsm8k", str(tmp_path / "nowhere")])
