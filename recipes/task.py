"""A task: tokenizer, prompts (a `datasets.Dataset` with `prompt_ids` and `answer`) and reward."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollout_service.tiny_models import byte_level_tokenizer

from . import gsm8k, tiny_task, tiny_tools
from .config import RecipeConfig
from .config.model import BYTE_TOKENIZER


@dataclass
class Task:
    name: str
    tokenizer: object
    dataset: object  # datasets.Dataset: prompt_ids (list[int]), answer (str)
    reward_fn: Callable[[str, str], float]
    stop_token_ids: tuple[int, ...]
    # a multi-turn task: a new Environment (recipes/environment.py) for each episode, and the most turns one
    # takes; None: single-turn, each completion scored by reward_fn
    environment: Callable[[], object] | None = None
    max_turns: int = 1

    def completion_text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def reward(self, token_ids: list[int], answer: str) -> float:
        return float(self.reward_fn(self.completion_text(token_ids), answer))


def build_task(cfg: RecipeConfig, tokenizer=None) -> Task:
    """The task cfg.task names: tiny (max_operand, ops), tiny_tools (max_operand, max_turns) or gsm8k (split,
    path, max_prompt_tokens)."""
    spec = cfg.task
    if spec.kind == "tiny":
        tokenizer = tokenizer or tiny_task.build_tokenizer()
        ds = tiny_task.build_dataset(spec.max_operand, spec.ops, seed=cfg.seed)
        ds = ds.map(lambda row: {"prompt_ids": tokenizer.encode(row["prompt"])})
        return Task("tiny", tokenizer, ds, tiny_task.reward, (tokenizer.eos_token_id,))
    if spec.kind == "tiny_tools":
        tokenizer = tokenizer or tiny_tools.build_tokenizer()
        ds = tiny_tools.build_dataset(spec.max_operand, seed=cfg.seed)
        ds = ds.map(lambda row: {"prompt_ids": tokenizer.encode(row["prompt"]),
                                 "target": "".join(tiny_tools.solution(row["operands"]))})
        stops = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(tiny_tools.CALL_END))
        return Task("tiny_tools", tokenizer, ds, tiny_task.reward, stops,
                    environment=lambda: tiny_tools.CalculatorEnv(tokenizer), max_turns=spec.max_turns)
    if spec.kind == "gsm8k":
        if tokenizer is None and cfg.model.tokenizer == BYTE_TOKENIZER:
            tokenizer = byte_level_tokenizer()
        elif tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.name)
        raw = gsm8k.load_gsm8k(spec.split, spec.path)
        ds = gsm8k.build_prompts(raw, tokenizer, spec.max_prompt_tokens)
        return Task("gsm8k", tokenizer, ds, gsm8k.reward, stop_ids(tokenizer, spec.stop_token_ids))
    raise ValueError(f"unknown task kind {spec.kind!r}")  # a new kind also goes into config.TASK_KINDS


def stop_ids(tokenizer, extra=None) -> tuple[int, ...]:
    """EOS plus chat end-of-turn tokens the tokenizer knows (e.g. <|im_end|>), plus `extra`."""
    ids = set(extra or ())
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return tuple(sorted(ids))
