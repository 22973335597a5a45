"""The embedded tiny tool task: three-number sums with a calculator tool, over several turns.

A prompt is "a+b+c=". The model calls the calculator as `c(x+y)`; its turn stops at ")" and the environment
answers with the observation "=z" (token ids, appended after the call). The model's last turn is its answer
and ends with <eos>. A solved episode reads

    3+14+5=  c(3+14)  =17  c(17+5)  =22  22<eos>
    prompt   turn 1   obs  turn 2   obs  turn 3

The reward is 1.0 for the right answer at the last turn, else 0.0. A call that does not parse ends the
episode ("malformed tool call"), as does a call to a tool other than `c` ("unknown tool"). Everything is built
in code: a one-character tokenizer (tiny_task's, with letters and parentheses), a `datasets.Dataset`.
"""
from __future__ import annotations

import random
import re

from .environment import EnvStep, EpisodeEnd

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARS = "0123456789+-=*()abcdefghijklmnopqrstuvwxyz"
CALL_END = ")"
CALCULATOR = "c"
_CALL = re.compile(r"^([a-z])\((\d+)([+\-*])(\d+)\)$")


def build_tokenizer():
    """One token per character; ids: <pad>=0, <eos>=1, <unk>=2, then CHARS in order."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def make_problems(max_operand: int = 9) -> list[dict]:
    """Every `a+b+c=` with 0 <= a, b, c <= max_operand."""
    r = range(max_operand + 1)
    return [{"prompt": f"{a}+{b}+{c}=", "answer": str(a + b + c), "operands": [a, b, c]}
            for a in r for b in r for c in r]


def build_dataset(max_operand: int = 9, seed: int = 0):
    import datasets

    problems = make_problems(max_operand)
    random.Random(seed).shuffle(problems)
    return datasets.Dataset.from_list(problems)


def solution(operands: list[int]) -> list[str]:
    """The solved episode's pieces after the prompt, model turns and observations in turn (the warm-up's
    target): c(a+b), =s, c(s+c), =t, t."""
    a, b, c = operands
    s = a + b
    return [f"c({a}+{b})", f"={s}", f"c({s}+{c})", f"={s + c}", str(s + c)]


class CalculatorEnv:
    """recipes.environment.Environment for one problem: the model's turns are token ids; a call's observation
    is encoded by the tokenizer (the tool's text, never the model's)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.answer = ""

    def reset(self, row: dict) -> list[int]:
        self.answer = row["answer"]
        return list(row["prompt_ids"])

    def step(self, model_tokens: list[int]) -> EnvStep:
        text = self.tok.decode(model_tokens, skip_special_tokens=True)  # read, never re-encoded
        if not text.endswith(CALL_END):  # an answer: <eos>, or the turn's budget ran out
            return EnvStep(reward=1.0 if text.strip() == self.answer else 0.0, done=True)
        call = _CALL.match(text)
        if call is None:
            raise EpisodeEnd(f"malformed tool call: {text!r}")
        name, x, op, y = call.groups()
        if name != CALCULATOR:
            raise EpisodeEnd(f"unknown tool {name!r}")
        value = {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
        return EnvStep(observation=self.tok.encode(f"={value}", add_special_tokens=False))
