"""The environment a multi-turn episode runs in: reset from a dataset row, then a step for each of the
model's turns.

Rule: everything crosses as token ids. The model's tokens are handed to the environment as ids and stay in
the episode's context as they were sampled; what the environment returns (a tool's output) is appended as
the token ids it gives. Nothing is detokenized and tokenized again, so the ids the trainer scores are the
ids every turn was sampled after (text round trips can merge or split tokens). An environment may decode
the model's ids to read a tool call; it never re-encodes them.

An episode ends when the environment says `done`, when it raises (EpisodeEnd: a refused tool call, a
tool that does not exist; any other exception: the environment failed), when the turns run out, or when
the context would overflow the engine's max_model_len. Each end is recorded with its reason
(recipes/episodes.py); the other episodes of the step go on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class EnvStep:
    """What an environment returns for one model turn."""
    observation: list[int] = field(default_factory=list)
    """Token ids appended after the model's turn (a tool's output, the next user message); masked out of the
    loss. Ignored when done."""
    reward: float = 0.0
    """This turn's reward; an episode's reward is the sum over its turns."""
    done: bool = False


class EpisodeEnd(Exception):
    """Raised by an environment's step to end the episode for a stated reason (a malformed tool call, an
    unknown tool): the reason is recorded, the turns so far are kept, and the reward is what was earned."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> list[int]:
        """Start an episode from a dataset row; returns the prompt's token ids."""

    def step(self, model_tokens: list[int]) -> EnvStep:
        """The model's turn (its sampled token ids, the stop token included where it stopped) -> what
        follows it; raise EpisodeEnd to end the episode with a reason."""
