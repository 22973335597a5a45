"""GSM8K: loading (hub or local JSONL through `datasets`), answer extraction, exact-match reward."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

HUB_NAME, HUB_CONFIG = "openai/gsm8k", "main"
INSTRUCTION = "Solve the problem step by step. Write the final answer as a number after '####'."

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_MARKED = re.compile(r"####\s*(-?\$?\d[\d,]*(?:\.\d+)?)")
_BOXED = re.compile(r"\\boxed\{\s*(-?\$?\d[\d,]*(?:\.\d+)?)\s*\}")


def load_gsm8k(split: str = "train", path: str | Path | None = None):
    """GSM8K as a `datasets.Dataset` with `question` and `answer`.

    path=None loads openai/gsm8k (config "main") from the hub; otherwise `path` is a JSONL file or a
    directory holding `<split>.jsonl`, read with datasets' json loader.
    """
    import datasets

    if path is None:
        return datasets.load_dataset(HUB_NAME, HUB_CONFIG, split=split)
    path = Path(path).expanduser()
    file = path / f"{split}.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no GSM8K JSONL at {file}")
    return datasets.load_dataset("json", data_files={split: str(file)}, split=split)


def normalize_number(text: str) -> str | None:
    """Canonical text of a number ('1,000' -> '1000', '$18.00' -> '18', '-0.50' -> '-0.5'), else None."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def gold_answer(answer_field: str) -> str:
    """The reference answer: what follows `#### ` in GSM8K's answer field, normalised."""
    if "####" not in answer_field:
        raise ValueError("GSM8K answer has no '####' marker")
    raw = answer_field.rsplit("####", 1)[1].strip()
    return normalize_number(raw) or raw


def extract_answer(completion: str) -> str | None:
    """The model's final answer: the last `#### x`, else the last \\boxed{x}, else the last number."""
    for pattern in (_MARKED, _BOXED):
        found = pattern.findall(completion)
        if found:
            return normalize_number(found[-1])
    numbers = _NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None


def reward(completion: str, answer: str) -> float:
    """1.0 when the extracted final answer equals the normalised reference, else 0.0."""
    got = extract_answer(completion)
    return 1.0 if got is not None and got == answer else 0.0


def format_prompt(tokenizer, question: str) -> list[int]:
    """Prompt token ids: the tokenizer's chat template when it has one, else plain text."""
    text = f"{question.strip()}\n{INSTRUCTION}"
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(f"Question: {text}\nAnswer:", add_special_tokens=False)


def build_prompts(dataset, tokenizer, max_prompt_tokens: int | None = None):
    """Columns `prompt_ids`, `answer` (normalised) and `target` (the worked solution, ending `#### answer`: what
    a warm-up trains on); prompts longer than max_prompt_tokens dropped."""
    def convert(row):
        return {"prompt_ids": format_prompt(tokenizer, row["question"]), "answer": gold_answer(row["answer"]),
                "target": row["answer"].strip()}

    out = dataset.map(convert, remove_columns=dataset.column_names)
    if max_prompt_tokens:
        out = out.filter(lambda row: len(row["prompt_ids"]) <= max_prompt_tokens)
    return out
