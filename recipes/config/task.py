"""The `task` section of the recipe config."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskConfig:
    """The `task` section: the prompts the policy answers and the reward its completions get."""
    kind: str = "tiny"
    """Which task: tiny (the built-in arithmetic problems) | tiny_tools (three-number sums with a calculator
    tool, over several turns: recipes/tiny_tools.py) | gsm8k."""
    max_operand: int = 19
    """tiny: problems "a<op>b=" with 0 <= a, b <= max_operand; tiny_tools: "a+b+c=" likewise."""
    max_turns: int = 4
    """tiny_tools: the most model turns an episode takes (each turn's budget is rollout.max_tokens)."""
    ops: str = "+"
    """tiny: the operators, each a character of "+-*"; "-" makes only the problems with b <= a."""
    split: str = "train"
    """gsm8k: the split to read: the hub's, or <split>.jsonl in the directory `path`."""
    path: str | None = None
    """gsm8k: a directory of <split>.jsonl files, or one JSONL file; null: the hub's openai/gsm8k (main)."""
    max_prompt_tokens: int | None = None
    """gsm8k: prompts longer than this many tokens are dropped; null (or 0) keeps all."""
    stop_token_ids: list[int] = field(default_factory=list)
    """gsm8k: more token ids that end a rollout, besides EOS and the chat end-of-turn tokens."""

