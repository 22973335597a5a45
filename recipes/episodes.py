"""Multi-turn episodes on a rollout pool: each turn continues its episode from the exact token ids so far.

A turn's request is the episode's whole context (prompt, then every model turn and observation, as ids)
with a turn's SamplingParams; every live episode's turn goes in one generate call, so a step's turns batch
like single-turn rollouts, and engines that cache prefixes (vLLM workers) reuse what earlier turns computed.

How an episode is trained. An episode is one or more segments, and each segment is one training sample:
its prompt is the context the model saw at the segment's first turn, then every token after it, with the
model's tokens in the loss (and in the KL) and the observations' tokens out (Sample.model_mask). The
trainer scores each sample in one forward; the canonical forward makes each model token's log-prob there
the one its turn reported, whatever batch, cache or worker that turn ran on.
- A chat template that keeps history (the environment returns observations, or whole contexts that extend
  the current one exactly): one segment, the concatenated trajectory.
- A template that rewrites history (a thinking model's drops earlier `<think>` blocks): where the next
  context as the environment renders it (EnvStep.context) does not extend the current one, a new segment
  starts with that context as its prompt. Scoring the final re-rendered conversation instead would score
  the earlier turns after a context they were never sampled after, and not at all where the template
  dropped them; each segment holds its turns after the very context each was sampled after.
Every segment carries its episode's reward, and the recipe gives every segment its episode's advantage
(one per episode, normalised over the rollout.n episodes of a prompt; recipes/grpo_job.py). The loss sums
over the masked tokens of a mini-batch's samples and divides by their tokens after the prompts
(recipes/trainer.py): an episode split into segments counts each of its model tokens once, with that
advantage; its re-rendered history (the new segments' prompts) is in neither the sum nor the count.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from rollout_service import Rollout, SamplingParams

from .environment import EnvStep, Environment, EpisodeEnd


@dataclass
class Segment:
    """One training sample of an episode: the context the model saw at the segment's first turn, then the
    turns and observations after it."""
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # every token after the prompt, model turns and observations
    logprobs: list[float] = field(default_factory=list)  # the rollout's log-prob of each model token, 0.0 elsewhere
    model_mask: list[bool] = field(default_factory=list)  # True on the model's tokens
    weight_versions: list[int] = field(default_factory=list)  # per token; -1 on observations
    turns: int = 0

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


@dataclass
class Episode:
    segments: list[Segment]  # in turn order; the last is the one the next turn continues
    reward: float = 0.0
    end: str | None = None  # why it ended: "done", "max turns", or the reason an error gave

    @property
    def context(self) -> list[int]:
        """The next turn's request: the current segment's prompt and every token after it."""
        return self.segments[-1].context

    @property
    def turns(self) -> int:
        return sum(seg.turns for seg in self.segments)

    def add_turn(self, rollout) -> None:
        self.segments[-1].add_turn(rollout)

    def continue_with(self, step: EnvStep) -> None:
        """The next turn's context from the environment's answer: an observation is appended; a whole
        context that extends the current one exactly appends the extension; any other starts a segment."""
        if step.context is None:
            self.segments[-1].add_observation(list(step.observation))
            return
        current, context = self.context, list(step.context)
        if context[:len(current)] == current:
            self.segments[-1].add_observation(context[len(current):])
        else:
            self.segments.append(Segment(prompt_ids=context))


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
        # a segment started for a turn that never came holds no model token: nothing to train (the first
        # stays, so that every episode keeps a rollout that carries its reward and its end)
        ep.segments = ep.segments[:1] + [seg for seg in ep.segments[1:] if seg.turns]
    return episodes


def _started(env: Environment, row: dict) -> Episode:
    try:
        return Episode(segments=[Segment(prompt_ids=list(env.reset(row)))])
    except Exception as e:  # an environment that cannot start: an empty episode with its reason
        return Episode(segments=[Segment(prompt_ids=[])], end=f"environment error at reset: {type(e).__name__}: {e}")


def _step(env: Environment, ep: Episode, turn_tokens: list[int], max_model_len: int) -> None:
    """The environment's answer to the episode's last turn; ends the episode where it says so, refuses the
    turn, fails, or gives a next context that leaves no room for another turn."""
    try:
        result = env.step(turn_tokens)
    except EpisodeEnd as e:
        ep.end = str(e) or type(e).__name__
        return
    except Exception as e:  # a failing environment, an EnvStep it could not build (EnvStep.__post_init__)
        ep.end = f"environment error: {type(e).__name__}: {e}"
        return
    ep.reward += float(result.reward)
    if result.done:
        ep.end = "done"
        return
    if result.context is not None and len(result.context) >= max_model_len:
        ep.end = (f"context overflows max_model_len: the next turn's context holds {len(result.context)} "
                  f"tokens >= {max_model_len}")
        return
    if result.context is None and len(ep.context) + len(result.observation) >= max_model_len:
        ep.end = (f"observation overflows max_model_len: {len(ep.context)} tokens + {len(result.observation)} "
                  f"observed >= {max_model_len}")
        return
    ep.continue_with(result)


@dataclass
class EpisodeRollout(Rollout):
    """A segment of an episode as the recipe's steps take rollouts (one per training sample): token_ids are
    every token after the segment's prompt, logprobs 0.0 on observations, and model_mask says which tokens
    the model sampled; the reward and the end are the episode's, turns the segment's."""
    model_mask: list[bool] = field(default_factory=list)
    reward: float = 0.0
    end: str = ""
    turns: int = 0
    episode: int = 0  # the episode's index among the step's (prompt-major)
    segment: int = 0  # the segment's index in its episode


def group_episodes(task, rows: list[dict], indices: list[int], step: int, rollout, run_seed: int, generate,
                   max_model_len: int, adapter: str | None = None) -> tuple[list[list[int]], list[EpisodeRollout]]:
    """rollout.n episodes per row (prompt-major, as group_requests orders single-turn requests), each turn
    with its own derived seed and at most rollout.max_tokens, on engines of `max_model_len`; returns (prompts,
    EpisodeRollouts): one per segment, an episode's segments together and in order (episode_of)."""
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
    return [seg.prompt_ids for ep in episodes for seg in ep.segments], episode_rollouts(episodes)


def episode_rollouts(episodes: Sequence[Episode]) -> list[EpisodeRollout]:
    """Every segment of every episode as a rollout, in order; a failed turn marks all of its episode's."""
    out = []
    for e, ep in enumerate(episodes):
        failed = ep.end.startswith("rollout failed")
        for k, seg in enumerate(ep.segments):
            out.append(EpisodeRollout(prompt_token_ids=seg.prompt_ids, token_ids=seg.token_ids, logprobs=seg.logprobs,
                                      finish_reason="error" if failed else "stop", error=ep.end if failed else None,
                                      weight_versions=_versions_after_turns(seg), model_mask=seg.model_mask,
                                      reward=ep.reward, end=ep.end, turns=seg.turns, episode=e, segment=k))
    return out


def episode_of(rollouts) -> list[int]:
    """Per rollout, the index of its episode: an episode's segments share one; a single-turn rollout is an
    episode of its own. Rule: episodes come in order and each one's segments together, first to last, so
    that episode e is the e-th of the step's rewards [P, n] (raises ValueError otherwise)."""
    out, last = [], (-1, 0)
    for ro in rollouts:
        key = (ro.episode, ro.segment) if isinstance(ro, EpisodeRollout) else (last[0] + 1, 0)
        if key not in ((last[0] + 1, 0), (last[0], last[1] + 1)):
            raise ValueError(f"rollouts out of episode order: episode {key[0]} segment {key[1]} after episode "
                             f"{last[0]} segment {last[1]}")
        out.append(key[0])
        last = key
    return out


def _versions_after_turns(seg: Segment) -> list[int] | None:
    """Per token, its weight version; an observation takes the version of the turn before it."""
    if all(v < 0 for v in seg.weight_versions):
        return None
    out, last = [], -1
    for v, is_model in zip(seg.weight_versions, seg.model_mask):
        last = v if is_model else last
        out.append(last)
    return out


def episode_metrics(rollouts) -> dict:
    """A step's episodes: turns and segments per episode, the share of model tokens, and how they ended
    (done, max turns, or an error: a refused or unknown tool call, a failing environment, the context
    full); {} for single-turn rollouts."""
    segments = [ro for ro in rollouts if isinstance(ro, EpisodeRollout)]
    if not segments:
        return {}
    episodes = [ro for ro in segments if ro.segment == 0]  # each episode once
    n = len(episodes)
    tokens = sum(len(ro.token_ids) for ro in segments)
    return {"episode/turns_mean": sum(ro.turns for ro in segments) / n,
            "episode/segments_mean": len(segments) / n,
            "episode/model_token_fraction": sum(map(sum, (ro.model_mask for ro in segments))) / max(1, tokens),
            "episode/done_fraction": sum(ep.end == "done" for ep in episodes) / n,
            "episode/max_turns_fraction": sum(ep.end == "max turns" for ep in episodes) / n,
            "episode/error_fraction": sum(ep.end not in ("done", "max turns") for ep in episodes) / n}
