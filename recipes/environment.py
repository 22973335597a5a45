"""The environment a multi-turn episode runs in: reset from a dataset row, then a step for each of the
model's turns.

Rule: everything crosses as token ids. The model's tokens are handed to the environment as ids and stay in
the episode's context as they were sampled; what the environment returns (a tool's output) is appended as
the token ids it gives. Nothing the model sampled is detokenized and tokenized again where it is trained, so
the ids the trainer scores are the ids every turn was sampled after (text round trips can merge or split
tokens). An environment may decode the model's ids to read a tool call, or to render history again for a
template that rewrites it; what it encodes from them is only ever the prompt of a later turn.

Chat templates come in two kinds, and an EnvStep says the next turn's context in either of two ways:
- A template that keeps history renders earlier turns as the model saw them; its environment returns the
  `observation`, the tokens after the model's turn (the tool message and the next generation prompt,
  rendered as the delta). The episode stays one concatenated trajectory.
- A template that rewrites history re-renders earlier turns differently (a thinking model's template drops
  the `<think>` blocks of earlier turns); its environment returns the whole next `context` as the template
  renders it. Where that context extends the current one exactly, only the extension is appended, as an
  observation; otherwise the episode starts a new segment whose prompt is that context, and the model's
  next turns are trained after it, the context they were sampled after (recipes/episodes.py). The
  re-rendered history is prompt, out of the loss: the model's tokens are trained only in the segment
  where they were sampled, as sampled.

An episode ends when the environment says `done`, when it raises (EpisodeEnd: a refused tool call, a
tool that does not exist; any other exception: the environment failed, an EnvStep that gives both an
observation and a context among them), when the turns run out, or when the context would overflow the
engine's max_model_len. Each end is recorded with its reason (recipes/episodes.py); the other episodes of
the step go on.
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
    context: list[int] | None = None
    """Instead of an observation: the whole context of the next turn as the environment's chat template
    renders it (a template that rewrites history). Ignored when done."""

    def __post_init__(self):
        # Rule: one way to say the next context. Both at once would leave it to us to guess which one the
        # template meant; raised inside the environment's step, it ends that episode as an environment error.
        if self.context is not None and self.observation:
            raise ValueError(f"an EnvStep gives an observation ({len(self.observation)} tokens) or a whole "
                             f"context ({len(self.context)} tokens), not both")
        if self.context is not None and not self.context:
            raise ValueError("an EnvStep's context is empty: a turn needs a prompt to continue from")


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
