"""GSM8K: the local JSONL loader (through `datasets`), answer extraction and the exact-match reward,
on the shared test split beside the checkout."""
from __future__ import annotations

from pathlib import Path

import pytest

from recipes import gsm8k

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"

# Rows in GSM8K's JSONL format (worked solution, then "#### answer"), for a checkout without the dataset beside it
WRITTEN_ROWS = [
    {"question": "Tom has 3 boxes of 14 pencils. How many pencils does he have?",
     "answer": "He has 3 * 14 = <<3*14=42>>42 pencils.\n#### 42"},
    {"question": "A tank holds 1,200 litres and loses 250 a day. How many litres are left after 4 days?",
     "answer": "It loses 250 * 4 = <<250*4=1000>>1,000 litres.\n"
               "So 1,200 - 1,000 = <<1200-1000=200>>200 are left.\n#### 200"},
    {"question": "Ana earns $7.50 an hour for 6 hours. How much does she earn?",
     "answer": "She earns 7.5 * 6 = <<7.5*6=45>>45 dollars.\n#### 45"},
]


@pytest.fixture(scope="module")
def gsm8k_data(tmp_path_factory):
    """(folder, row count, first gold answer) of the test split: the real GSM8K JSONL where it sits beside the
    checkout, else WRITTEN_ROWS, so the loader, reward and prompt tests run in every checkout."""
    import json
    if (DATA / "test.jsonl").is_file():
        return DATA, 1319, "18"
    folder = tmp_path_factory.mktemp("gsm8k")
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in WRITTEN_ROWS))
    return folder, len(WRITTEN_ROWS), "42"


def test_jsonl_loader_through_datasets(gsm8k_data):
    import datasets

    folder, rows, _ = gsm8k_data
    test = gsm8k.load_gsm8k("test", folder)
    assert isinstance(test, datasets.Dataset)
    assert len(test) == rows and set(test.column_names) == {"question", "answer"}
    same = gsm8k.load_gsm8k("test", folder / "test.jsonl")  # a file path works too
    assert same[0] == test[0]
    with pytest.raises(FileNotFoundError):
        gsm8k.load_gsm8k("validation", folder)


def test_reward_on_the_test_split(gsm8k_data):
    folder, _, first = gsm8k_data
    test = gsm8k.load_gsm8k("test", folder)
    golds = [gsm8k.gold_answer(a) for a in test["answer"]]
    assert all(g is not None and gsm8k.normalize_number(g) == g for g in golds)
    # The reference solution itself earns the reward; a wrong final number does not.
    assert all(gsm8k.reward(a, g) == 1.0 for a, g in zip(test["answer"], golds))
    wrong = [a.rsplit("####", 1)[0] + f"#### {int(g) + 1}" for a, g in zip(test["answer"][:200], golds[:200])]
    assert all(gsm8k.reward(w, g) == 0.0 for w, g in zip(wrong, golds[:200]))
    assert test[0]["answer"].endswith(f"#### {first}") and golds[0] == first


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


def test_prompts_and_task_with_a_local_tokenizer(gsm8k_data):
    from recipes.config import load_config
    from recipes.task import build_task
    from recipes.tiny_task import build_tokenizer

    folder, rows, first = gsm8k_data
    cfg = load_config(Path(__file__).resolve().parents[1] / "recipes" / "configs" / "gsm8k_qwen.yaml",
                      ["task.split=test", f"task.path={folder}", "task.max_prompt_tokens=100000"])
    tok = build_tokenizer()  # no chat template: the plain "Question: ... Answer:" format
    task = build_task(cfg, tokenizer=tok)
    assert len(task.dataset) == rows and task.dataset[0]["answer"] == first
    assert task.stop_token_ids == (tok.eos_token_id,)
    question = gsm8k.load_gsm8k("test", folder)[0]["question"]
    expect = tok.encode(f"Question: {question.strip()}\n{gsm8k.INSTRUCTION}\nAnswer:", add_special_tokens=False)
    assert task.dataset[0]["prompt_ids"] == expect  # no chat template: the plain question/answer format
    assert task.reward(tok.encode(f"#### {first}"), first) == 1.0
    assert task.reward(tok.encode(f"#### {int(first) + 1}"), first) == 0.0


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
