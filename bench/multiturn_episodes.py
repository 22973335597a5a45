"""bench.multiturn's workload: a synthetic environment (fixed-length observations) and one timed pass of the
episodes through recipes.episodes.run_episodes, each turn's tokens, prefix-cache hits and seconds counted."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from recipes.environment import EnvStep
from recipes.episodes import run_episodes
from rollout_service import SamplingParams


class SyntheticEnv:
    """`turns` model turns; after each but the last, `observation_len` tokens that depend on the turn's first
    token (so a later turn's context depends on what was sampled, as a tool's output does)."""

    def __init__(self, turns: int, observation_len: int, vocab: int):
        self.turns, self.observation_len, self.vocab, self.steps = turns, observation_len, vocab, 0

    def reset(self, row: dict) -> list[int]:
        self.steps = 0
        return list(row["prompt"])

    def step(self, model_tokens: list[int]) -> EnvStep:
        self.steps += 1
        first = model_tokens[0] if model_tokens else 0
        observation = [(first + 7919 * k) % self.vocab for k in range(self.observation_len)]
        return EnvStep(observation=observation, done=self.steps == self.turns)


def prompts(episodes: int, prompt_len: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(vocab) for _ in range(prompt_len)]} for _ in range(episodes)]


def max_model_len(args) -> int:
    """The longest context of an episode (its last turn's completion included), with room to spare."""
    return args.prompt_len + args.turns * (args.max_tokens + args.observation_len) + 8


@dataclass
class Pass:
    """One pass over the episodes: its wall seconds and, per turn, seconds, prompt tokens and the prompt
    tokens the prefix cache served."""
    seconds: float = 0.0
    model_tokens: int = 0
    observation_tokens: int = 0
    turns_run: int = 0
    turn_seconds: list[float] = field(default_factory=list)
    turn_prompt_tokens: list[int] = field(default_factory=list)
    turn_cached_tokens: list[int] = field(default_factory=list)


def run_pass(generate, rows: list[dict], args, vocab: int) -> Pass:
    """The episodes through run_episodes with `generate(prompts, params) -> Rollouts`: every live episode's
    turn in one call, each turn's params seeded per episode and turn, no stop token (every turn runs
    max_tokens)."""
    result = Pass()

    def timed(prompts_, params):
        start = time.perf_counter()
        out = generate(prompts_, params)
        result.turn_seconds.append(time.perf_counter() - start)
        bad = [r.error for r in out if not r.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} rollouts failed: {bad[0]}")
        result.turn_prompt_tokens.append(sum(len(p) for p in prompts_))
        result.turn_cached_tokens.append(sum(r.stats.cached_prompt_tokens for r in out))
        return out

    def params_for(episode: int, turn: int, room: int) -> SamplingParams:
        return SamplingParams(max_tokens=min(args.max_tokens, room), temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed + 1000 * episode + turn)

    envs = [SyntheticEnv(args.turns, args.observation_len, vocab) for _ in rows]
    start = time.perf_counter()
    episodes = run_episodes(envs, rows, timed, params_for, args.turns, max_model_len(args))
    result.seconds = time.perf_counter() - start
    ended = [ep.end for ep in episodes if ep.end != "done"]
    if ended:
        raise RuntimeError(f"{len(ended)} episodes ended early: {ended[0]}")
    segments = [seg for ep in episodes for seg in ep.segments]
    result.model_tokens = sum(sum(seg.model_mask) for seg in segments)
    result.observation_tokens = sum(len(seg.model_mask) - sum(seg.model_mask) for seg in segments)
    result.turns_run = sum(ep.turns for ep in episodes)
    return result
