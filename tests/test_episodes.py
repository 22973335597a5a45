"""Multi-turn episodes (recipes/episodes.py, recipes/environment.py) on the native engine with a tiny model
saved to disk and loaded the standard way: every model token of every turn reports the log-prob the trainer
gets scoring the whole trajectory in one forward, bit for bit, whichever episodes share a turn's batch;
observations are out of the loss; each way an episode can end is recorded with its reason. The control,
determinism off, does not match."""
from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM

from episodes_shared import bits, trainer_bits

from recipes.batch import Sample, pack, pack_flat
from recipes.environment import EnvStep, EpisodeEnd
from recipes.episodes import run_episodes
from rollout_service import Engine, SamplingParams
from rollout_service.tiny_models import tiny_model

VOCAB_LO, VOCAB_HI = 3, 60


class ToolEnv:
    """A scripted tool environment: each turn's observation is a function of the model's tokens (so later
    turns depend on what was sampled), done after `turns` turns with a reward per turn."""

    def __init__(self, turns: int = 3, fail_at: int | None = None, error: Exception | None = None,
                 observation_len: int = 5):
        self.turns, self.fail_at, self.error, self.observation_len = turns, fail_at, error, observation_len
        self.seen: list[list[int]] = []

    def reset(self, row: dict) -> list[int]:
        return list(row["prompt"])

    def step(self, model_tokens: list[int]) -> EnvStep:
        self.seen.append(model_tokens)
        if self.fail_at == len(self.seen):
            raise self.error
        first = model_tokens[0] if model_tokens else 0
        observation = [VOCAB_LO + (first + k) % (VOCAB_HI - VOCAB_LO) for k in range(self.observation_len)]
        return EnvStep(observation=observation, reward=0.25, done=len(self.seen) == self.turns)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("episodes-model")
    tiny_model("qwen2", seed=11).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trainer(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def _rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": torch.randint(VOCAB_LO, VOCAB_HI, (int(torch.randint(3, 12, (1,), generator=g)),),
                                     generator=g).tolist()} for _ in range(n)]


def _params(determinism: str = "verified"):
    def params_for(episode: int, turn: int, room: int) -> SamplingParams:
        return SamplingParams(max_tokens=min(6, room), temperature=1.0, seed=1000 * episode + turn,
                              determinism=determinism)
    return params_for


def _run(engine, rows, determinism="verified", **env_kw):
    envs = [ToolEnv(**env_kw) for _ in rows]
    return run_episodes(envs, rows, engine.generate, _params(determinism), max_turns=4, max_model_len=96), envs


def _only(ep):
    """An episode of observations is one segment: the concatenated trajectory."""
    (seg,) = ep.segments
    return seg


def test_every_model_token_of_every_turn_is_the_trainers(checkpoint, trainer):
    engine = Engine(str(checkpoint))
    episodes, envs = _run(engine, _rows(6))
    assert all(ep.end == "done" and ep.turns == 3 for ep in episodes)
    for ep, env in zip(episodes, envs):
        seg = _only(ep)
        model_logprobs = [x for x, m in zip(seg.logprobs, seg.model_mask) if m]
        assert bits(model_logprobs) == trainer_bits(trainer, seg)
        assert sum(not m for m in seg.model_mask) == 2 * 5  # two observations between three turns
        assert ep.reward == 0.75
        # the environment got the model's ids as sampled; they stand in the context unchanged
        assert [t for t, m in zip(seg.token_ids, seg.model_mask) if m] == [t for turn in env.seen for t in turn]


def test_a_turns_batch_does_not_change_an_episode(checkpoint):
    """Each episode run alone, and all together (their turns batched, prefixes cached): the same ids and bits."""
    engine = Engine(str(checkpoint))
    rows = _rows(5, seed=1)
    together, _ = _run(engine, rows)
    for i, row in enumerate(rows):
        (alone,) = run_episodes([ToolEnv()], [row], engine.generate,
                                lambda _, turn, room, i=i: _params()(i, turn, room), max_turns=4, max_model_len=96)
        assert _only(alone).token_ids == _only(together[i]).token_ids
        assert bits(_only(alone).logprobs) == bits(_only(together[i]).logprobs)


def test_the_unprotected_path_differs(checkpoint, trainer):
    engine = Engine(str(checkpoint))
    episodes, _ = _run(engine, _rows(6), determinism="off")
    mismatched = sum(bits(x for x, m in zip(seg.logprobs, seg.model_mask) if m) != trainer_bits(trainer, seg)
                     for seg in map(_only, episodes))
    assert mismatched > 0


def test_observations_are_out_of_the_loss(checkpoint):
    engine = Engine(str(checkpoint))
    (ep,), _ = _run(engine, _rows(1, seed=2))
    ep = _only(ep)
    sample = Sample(ep.prompt_ids, ep.token_ids, ep.logprobs, 1.0, model_mask=ep.model_mask)
    p = len(ep.prompt_ids)
    for packed in (pack([sample])["loss_mask"][0], pack_flat([sample])["loss_mask"][0]):
        assert packed[p - 1:p - 1 + len(ep.token_ids)].tolist() == ep.model_mask
        assert int(packed.sum()) == sum(ep.model_mask)
    with pytest.raises(ValueError, match="model_mask"):
        pack([Sample(ep.prompt_ids, ep.token_ids, ep.logprobs, 1.0, model_mask=ep.model_mask[:-1])])


@pytest.mark.parametrize("error, reason", [(EpisodeEnd("malformed tool call: '(1+'"), "malformed tool call: '(1+'"),
                                           (EpisodeEnd("unknown tool 'w'"), "unknown tool 'w'"),
                                           (RuntimeError("boom"), "environment error: RuntimeError: boom")])
def test_an_episode_that_fails_ends_with_its_reason_and_the_others_go_on(checkpoint, error, reason):
    engine = Engine(str(checkpoint))
    rows = _rows(3, seed=3)
    envs = [ToolEnv(), ToolEnv(fail_at=2, error=error), ToolEnv()]
    episodes = run_episodes(envs, rows, engine.generate, _params(), max_turns=4, max_model_len=96)
    assert [ep.end for ep in episodes] == ["done", reason, "done"]
    assert episodes[1].turns == 2 and episodes[1].reward == 0.25  # the first turn's reward is kept
    assert sum(not m for m in _only(episodes[1]).model_mask) == 5  # the failed turn's observation never came


def test_an_observation_that_overflows_max_model_len_ends_the_episode(checkpoint):
    engine = Engine(str(checkpoint))
    episodes, _ = _run(engine, _rows(2, seed=4), observation_len=90)
    assert all(ep.end.startswith("observation overflows max_model_len") and ep.turns == 1 for ep in episodes)
