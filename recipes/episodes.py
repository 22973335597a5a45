"""Multi-turn episodes on a rollout pool: each turn continues its episode from the exact token ids so far.

A turn's request is the episode's whole context (prompt, then every model turn and observation, as ids)
with a turn's SamplingParams; every live episode's turn goes in one generate call, so a step's turns batch
like single-turn rollouts, and engines that cache prefixes (vLLM workers) reuse what earlier turns computed. An episode
becomes one training sample: the prompt, then every token after it, with the model's tokens in the loss
(and in the KL) and the observations' tokens out (Sample.model_mask). The trainer scores the whole
trajectory in one forward; the canonical forward makes each model token's log-prob there the one its turn
reported, whatever batch, cache or worker that turn ran on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from rollout_service import Rollout, SamplingParams

from .environment import Environment, EpisodeEnd


@dataclass
class Episode:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # every token after the prompt, model turns and observations
    logprobs: list[float] = field(default_factory=list)  # the rollout's log-prob of each model token, 0.0 elsewhere
    model_mask: list[bool] = field(default_factory=list)  # True on the model's tokens
    weight_versions: list[int] = field(default_factory=list)  # per token; -1 on observations
    reward: float = 0.0
    turns: int = 0
    end: str | None = None  # why it ended: "done", "max turns", or the reason an error gave

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add_turn(self, rollout) -> None:
        self.token_ids += rollout.token_ids
        self.logprobs += rollout.logprobs
        self.model_mask += [True] * len(rollout.token_ids)
        versions = rollout.weight_versions or [-1] * len(rollout.token_ids)
        self.weight_versions += versions
        self.turns += 1

    def add_observation(self, tokens: list[int]) -> None:
        self.token_ids += tokens
        self.logprobs += [0.0] * len(tokens)
        self.model_mask += [False] * len(tokens)
        self.weight_versions += [-1] * len(tokens)


def run_episodes(envs: Sequence[Environment], rows: Sequence[dict], generate: Callable, params_for: Callable,
                 max_turns: int, max_model_len: int) -> list[Episode]:
    """One episode per (environment, row), turn by turn until each ends. generate(prompts, params) -> Rollouts
    (RolloutClient.generate); params_for(episode index, turn index, room) -> the turn's SamplingParams, where
    `room` is how many tokens the context may still grow by (its max_tokens must not exceed it)."""
    episodes = []
    for env, row in zip(envs, rows):
        episodes.append(_started(env, row))
    for turn in range(max_turns):
        for ep in episodes:
            if ep.end is None and len(ep.context) >= max_model_len:
                ep.end = f"max_model_len: the context holds {len(ep.context)} tokens"
        live = [i for i, ep in enumerate(episodes) if ep.end is None]
        if not live:
            break
        prompts = [episodes[i].context for i in live]
        params = [params_for(i, turn, max_model_len - len(episodes[i].context)) for i in live]
        for i, rollout in zip(live, generate(prompts, params)):
            ep = episodes[i]
            if not rollout.ok:
                ep.end = f"rollout failed: {rollout.finish_reason}: {rollout.error}"
                continue
            ep.add_turn(rollout)
            _step(envs[i], ep, list(rollout.token_ids), max_model_len)
    for ep in episodes:
        if ep.end is None:
            ep.end = "max turns"
    return episodes


def _started(env: Environment, row: dict) -> Episode:
    try:
        return Episode(prompt_ids=list(env.reset(row)))
    except Exception as e:  # an environment that cannot start: an empty episode with its reason
        return Episode(prompt_ids=[], end=f"environment error at reset: {type(e).__name__}: {e}")


def _step(env: Environment, ep: Episode, turn_tokens: list[int], max_model_len: int) -> None:
    """The environment's answer to the episode's last turn; ends the episode where it says so, refuses the
    turn, fails, or returns an observation that leaves no room for another turn."""
    try:
        result = env.step(turn_tokens)
    except EpisodeEnd as e:
        ep.end = str(e) or type(e).__name__
        return
    except Exception as e:
        ep.end = f"environment error: {type(e).__name__}: {e}"
        return
    ep.reward += float(result.reward)
    if result.done:
        ep.end = "done"
        return
    if len(ep.context) + len(result.observation) >= max_model_len:
        ep.end = (f"observation overflows max_model_len: {len(ep.context)} tokens + {len(result.observation)} "
                  f"observed >= {max_model_len}")
        return
    ep.add_observation(list(result.observation))


@dataclass
class EpisodeRollout(Rollout):
    """An episode as the recipe's steps take rollouts: token_ids are every token after the prompt, logprobs 0.0
    on observations, and model_mask says which tokens the model sampled; the reward is the episode's."""
    model_mask: list[bool] = field(default_factory=list)
    reward: float = 0.0
    end: str = ""
    turns: int = 0


def group_episodes(task, rows: list[dict], indices: list[int], step: int, rollout, run_seed: int, generate,
                   max_model_len: int, adapter: str | None = None) -> tuple[list[list[int]], list[EpisodeRollout]]:
    """rollout.n episodes per row (prompt-major, as group_requests orders single-turn requests), each turn
    with its own derived seed and at most rollout.max_tokens, on engines of `max_model_len`; returns (prompts,
    EpisodeRollouts)."""
    from .rollouts import sample_seed
    n = rollout.n
    keys = [(index, j) for index in indices for j in range(n)]

    def params_for(e: int, turn: int, room: int) -> SamplingParams:
        index, j = keys[e]
        return SamplingParams(max_tokens=max(1, min(rollout.max_tokens, room)), temperature=rollout.temperature,
                              top_k=rollout.top_k, top_p=rollout.top_p,
                              seed=sample_seed(run_seed, step, index, j, turn), stop_token_ids=tuple(task.stop_token_ids),
                              determinism=rollout.determinism, adapter=adapter)

    envs = [task.environment() for _ in keys]
    episodes = run_episodes(envs, [row for row in rows for _ in range(n)], generate, params_for, task.max_turns,
                            max_model_len)
    out = []
    for ep in episodes:
        versions = _versions_after_turns(ep)
        out.append(EpisodeRollout(prompt_token_ids=ep.prompt_ids, token_ids=ep.token_ids, logprobs=ep.logprobs,
                                  finish_reason="error" if ep.end.startswith("rollout failed") else "stop",
                                  error=ep.end if ep.end.startswith("rollout failed") else None,
                                  weight_versions=versions, model_mask=ep.model_mask, reward=ep.reward, end=ep.end,
                                  turns=ep.turns))
    return [ep.prompt_ids for ep in episodes], out


def _versions_after_turns(ep: Episode) -> list[int] | None:
    """Per token, its weight version; an observation takes the version of the turn before it."""
    if all(v < 0 for v in ep.weight_versions):
        return None
    out, last = [], -1
    for v, is_model in zip(ep.weight_versions, ep.model_mask):
        last = v if is_model else last
        out.append(last)
    return out


def episode_metrics(rollouts) -> dict:
    """A step's episodes: turns, the share of model tokens, and how they ended (done, max turns, or an error:
    a refused or unknown tool call, a failing environment, the context full); {} for single-turn rollouts."""
    episodes = [ro for ro in rollouts if isinstance(ro, EpisodeRollout)]
    if not episodes:
        return {}
    n = len(episodes)
    tokens = sum(len(ep.token_ids) for ep in episodes)
    return {"episode/turns_mean": sum(ep.turns for ep in episodes) / n,
            "episode/model_token_fraction": sum(map(sum, (ep.model_mask for ep in episodes))) / max(1, tokens),
            "episode/done_fraction": sum(ep.end == "done" for ep in episodes) / n,
            "episode/max_turns_fraction": sum(ep.end == "max turns" for ep in episodes) / n,
            "episode/error_fraction": sum(ep.end not in ("done", "max turns") for ep in episodes) / n}
