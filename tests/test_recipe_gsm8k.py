"""GSM8K: the local JSONL loader (through `datasets`), answer extraction and the exact-match reward,
on the shared test split beside the checkout."""
from __future__ import annotations

from pathlib import Path

import pytest

from recipes import gsm8k

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"

needs_data = pytest.mark.skipif(not (DATA / "test.jsonl").is_file(), reason=f"no GSM8K JSONL at {DATA}")


@needs_data
def test_jsonl_loader_through_datasets():
    import datasets

    test = gsm8k.load_gsm8k("test", DATA)
    assert isinstance(test, datasets.Dataset)
    assert len(test) == 1319 and set(test.column_names) == {"question", "answer"}
    same = gsm8k.load_gsm8k("test", DATA / "test.jsonl")  # a file path works too
    assert same[0] == test[0]
    with pytest.raises(FileNotFoundError):
        gsm8k.load_gsm8k("validation", DATA)


@needs_data
def test_reward_on_the_test_split():
    test = gsm8k.load_gsm8k("test", DATA)
    golds = [gsm8k.gold_answer(a) for a in test["answer"]]
    assert all(g is not None and gsm8k.normalize_number(g) == g for g in golds)
    # The reference solution itself earns the reward; a wrong final number does not.
    assert all(gsm8k.reward(a, g) == 1.0 for a, g in zip(test["answer"], golds))
    wrong = [a.rsplit("####", 1)[0] + f"#### {int(g) + 1}" for a, g in zip(test["answer"][:200], golds[:200])]
    assert all(gsm8k.reward(w, g) == 0.0 for w, g in zip(wrong, golds[:200]))
    assert test[0]["answer"].endswith("#### 18") and golds[0] == "18"


def test_answer_extraction_and_normalisation():
    assert gsm8k.normalize_number("1,000") == "1000"
    assert gsm8k.normalize_number("$18.00") == "18"
    assert gsm8k.normalize_number("-0.50") == "-0.5"
    assert gsm8k.normalize_number("abc") is None
    assert gsm8k.extract_answer("5 + 3 = 8 so the answer is\n#### 8\nthen 9") == "8"  # the marker wins
    assert gsm8k.extract_answer("The answer is \\boxed{1,234}.") == "1234"
    assert gsm8k.extract_answer("She pays $12.50 in total.") == "12.5"
    assert gsm8k.extract_answer("no number here") is None
    assert gsm8k.reward("#### 72", "72") == 1.0
    assert gsm8k.reward("#### 72.0", "72") == 1.0
    assert gsm8k.reward("#### 7", "72") == 0.0
    assert gsm8k.reward("", "72") == 0.0


@needs_data
def test_prompts_and_task_with_a_local_tokenizer():
    from recipes.config import load_config
    from recipes.task import build_task
    from recipes.tiny_task import build_tokenizer

    cfg = load_config(Path(__file__).resolve().parents[1] / "recipes" / "configs" / "gsm8k_qwen.yaml",
                      ["task.split=test", f"task.path={DATA}", "task.max_prompt_tokens=100000"])
    tok = build_tokenizer()  # no chat template: the plain "Question: ... Answer:" format
    task = build_task(cfg, tokenizer=tok)
    assert len(task.dataset) == 1319 and task.dataset[0]["answer"] == "18"
    assert task.stop_token_ids == (tok.eos_token_id,)
    question = gsm8k.load_gsm8k("test", DATA)[0]["question"]
    expect = tok.encode(f"Question: {question.strip()}\n{gsm8k.INSTRUCTION}\nAnswer:", add_special_tokens=False)
    assert task.dataset[0]["prompt_ids"] == expect  # no chat template: the plain question/answer format
    assert task.reward(tok.encode("#### 18"), "18") == 1.0


def test_a_tiny_policy_reads_gsm8k_through_the_byte_level_tokenizer_and_warms_up_on_worked_solutions(tmp_path):
    """`model.tokenizer: bytes` (the quality study's long-completion config): no download; prompts in the chat
    template, one id a byte; the warm-up's targets are the worked solutions, which earn the reward. Rows in
    GSM8K's JSONL format, written here, so the test needs no data beside the checkout."""
    import json

    from recipes.config import load_config
    from recipes.models import initial_model
    from recipes.task import build_task
    from recipes.warmup import answer_examples

    rows = [{"question": "A baker makes 12 loaves a day. How many loaves does he make in 5 days?",
             "answer": "He makes 12 * 5 = <<12*5=60>>60 loaves.\n#### 60"},
            {"question": "Long question " + "with many words " * 40 + "?", "answer": "It is 1.\n#### 1"}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(Path(__file__).resolve().parents[1] / "recipes" / "configs" / "gpu_quality_gsm8k.yaml",
                      ["task.split=test", f"task.path={tmp_path}", "model.hidden_size=32", "model.num_layers=1",
                       "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64"])
    task = build_task(cfg)
    tok = task.tokenizer
    assert len(tok) == 259 and tok.convert_tokens_to_ids("<|im_end|>") in task.stop_token_ids
    assert len(task.dataset) == 1  # the second question is over max_prompt_tokens (512 bytes)
    row = task.dataset[0]
    text = f"<|im_start|>user\n{rows[0]['question']}\n{gsm8k.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(row["prompt_ids"]) == text and len(row["prompt_ids"]) < len(text.encode())  # specials: 1 id
    prompt, target = answer_examples(task)[0]
    assert prompt == row["prompt_ids"] and target[-1] in task.stop_token_ids
    solution = tok.decode(target[:-1])
    assert solution == rows[0]["answer"] and row["answer"] == "60"
    assert len(target) - 1 == len(solution.encode())  # one token a byte: a solution is a completion of its bytes
    assert task.reward(target[:-1], row["answer"]) == 1.0
    assert task.reward(tok.encode("He makes 59.\n#### 59"), row["answer"]) == 0.0
    assert initial_model(cfg, tok).config.vocab_size == 259
