"""The embedded tiny task: small-number addition with an exact reward and a character tokenizer.

Everything is built in code (no downloads): the tokenizer is a real `PreTrainedTokenizerFast` made
with the `tokenizers` library, the prompts are a `datasets.Dataset`.
"""
from __future__ import annotations

import random

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARS = "0123456789+-=*"


def build_tokenizer():
    """One token per character; ids: <pad>=0, <eos>=1, <unk>=2, then CHARS in order."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back without spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def make_problems(max_operand: int = 19, ops: str = "+") -> list[dict]:
    """Every `a<op>b=` with 0 <= a, b <= max_operand (subtraction only where the result is >= 0)."""
    out = []
    for op in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "-" and b > a:
                    continue
                value = {"+": a + b, "-": a - b, "*": a * b}[op]
                out.append({"prompt": f"{a}{op}{b}=", "answer": str(value)})
    return out


def build_dataset(max_operand: int = 19, ops: str = "+", seed: int = 0):
    """A `datasets.Dataset` with `prompt` and `answer` columns, in a seeded order."""
    import datasets

    problems = make_problems(max_operand, ops)
    random.Random(seed).shuffle(problems)
    return datasets.Dataset.from_list(problems)


def reward(completion: str, answer: str) -> float:
    """Exact match of the completion (special tokens already stripped) with the answer."""
    return 1.0 if completion.strip() == answer else 0.0


def sft_pairs(dataset) -> list[tuple[str, str]]:
    """(prompt, target) pairs for the supervised warm-up: the answer then <eos>."""
    return [(row["prompt"], row["answer"]) for row in dataset]
