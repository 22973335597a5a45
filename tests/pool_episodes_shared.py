"""Multi-turn episodes through a rollout pool, shared by the pool tests on native workers
(test_pool_episodes.py) and on vLLM workers (test_vllm_pool_episodes.py): recipes.episodes.run_episodes
with the pool client's generate, a scripted environment, a generate that records every turn (and, sending
the requests one at a time, which worker served each), and the bitwise comparisons."""
from __future__ import annotations

import struct
import time

import torch

import trainer_patch
from recipes.environment import EnvStep
from recipes.episodes import run_episodes
from rollout_service import SamplingParams

VOCAB_LO, VOCAB_HI = 3, 60
OBSERVATION_LEN = 5
TEMPERATURE = 1.0


class ScriptedEnv:
    """Each turn's observation is a function of the model's first token (so later turns depend on what was
    sampled); done after `turns` turns."""

    def __init__(self, turns: int):
        self.turns, self.steps = turns, 0

    def reset(self, row: dict) -> list[int]:
        return list(row["prompt"])

    def step(self, model_tokens: list[int]) -> EnvStep:
        self.steps += 1
        first = model_tokens[0] if model_tokens else 0
        observation = [VOCAB_LO + (first + 7 * k) % (VOCAB_HI - VOCAB_LO) for k in range(OBSERVATION_LEN)]
        return EnvStep(observation=observation, reward=1.0, done=self.steps == self.turns)


def rows(n: int, seed: int, lo: int, hi: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": torch.randint(VOCAB_LO, VOCAB_HI, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                     generator=g).tolist()} for _ in range(n)]


def seed_of(episode: int, turn: int) -> int:
    return 1000 * episode + turn


def episode_of(params: SamplingParams) -> int:
    return params.seed // 1000


def params_for(max_tokens: int, determinism: str = "verified"):
    def make(episode: int, turn: int, room: int) -> SamplingParams:
        return SamplingParams(max_tokens=min(max_tokens, room), temperature=TEMPERATURE, seed=seed_of(episode, turn),
                              determinism=determinism)
    return make


def run(generate, episode_rows: list[dict], turns: int, max_tokens: int, determinism: str = "verified",
        max_model_len: int = 256):
    """The episodes, each `turns` turns long, every live episode's turn in one generate call."""
    envs = [ScriptedEnv(turns) for _ in episode_rows]
    episodes = run_episodes(envs, episode_rows, generate, params_for(max_tokens, determinism), max_turns=turns + 1,
                            max_model_len=max_model_len)
    for ep in episodes:
        assert ep.end == "done" and ep.turns == turns, ep.end
    return episodes


class Recorded:
    """A generate that records each call's prompts, params and rollouts (call = turn); `before(turn)`, where
    given, runs before each turn's requests are sent."""

    def __init__(self, generate, before=None):
        self.generate, self.before = generate, before
        self.turns: list[tuple[list, list, list]] = []

    def __call__(self, prompts, params):
        if self.before is not None:
            self.before(len(self.turns))
        out = self.generate(prompts, params)
        self.turns.append((prompts, params, out))
        return out


class OneAtATime:
    """A pool client's generate that sends a turn's requests one at a time and notes, from the pool's
    per-worker counts, which worker served each: `served[episode]` lists its turns' workers in order."""

    def __init__(self, pool):
        self.pool = pool
        self.served: dict[int, list[int]] = {}

    def __call__(self, prompts, params):
        out = []
        for prompt, p in zip(prompts, params):
            before = completed(self.pool)
            [rollout] = self.pool.generate([prompt], [p])
            grew = [i for i, (a, b) in enumerate(zip(completed(self.pool), before)) if a != b]
            assert len(grew) == 1, grew  # nothing else runs on this pool
            self.served.setdefault(episode_of(p), []).append(grew[0])
            out.append(rollout)
        return out


def run_with_a_worker_killed_during_a_turn(pool, rows, turns: int, max_tokens: int):
    """The episodes, with the pool's worker 0 killed once it holds a request of the second turn; asserts that
    the pool ran the requests it lost again (on another worker) and returns the episodes."""
    import ray
    wait_ready(pool)
    retried = pool.stats()["retried"]
    calls: list[int] = []

    def kill_during_second_turn(prompts, params):
        ref, _ = pool.submit(prompts, params)
        if len(calls) == 1:
            deadline = time.monotonic() + 30
            while pool.stats()["workers"][0]["in_flight"] == 0:
                assert time.monotonic() < deadline, pool.stats()
            ray.kill(pool.workers()[0])
        calls.append(1)
        return ray.get(ref)
    episodes = run(kill_during_second_turn, rows, turns, max_tokens)
    assert pool.stats()["retried"] > retried, pool.stats()  # the kill caught requests in flight
    return episodes


def completed(pool) -> list[int]:
    return [w["completed"] for w in pool.stats()["workers"]]


def wait_ready(pool, timeout: float = 180.0) -> None:
    """Until every worker of the pool serves (a killed one has been replaced)."""
    deadline = time.monotonic() + timeout
    while not all(w["state"] == "ready" for w in pool.stats()["workers"]):
        assert time.monotonic() < deadline, pool.stats()
        time.sleep(0.1)


def bits(values) -> tuple[bytes, ...]:
    return tuple(struct.pack("<d", float(x)) for x in values)


def episode_bits(ep) -> tuple:
    """What must match bitwise between two runs of an episode: every token, every log-prob's bits, which
    tokens are the model's, and how it ended."""
    return tuple((tuple(seg.prompt_ids), tuple(seg.token_ids), bits(seg.logprobs), tuple(seg.model_mask))
                 for seg in ep.segments), ep.end


def assert_same_episodes(got, want, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert episode_bits(g) == episode_bits(w), f"{what}: episode {i} differs"


def trainer_mismatches(trainer, ep) -> int:
    """Model tokens of the episode whose reported log-prob is not, bit for bit, the trainer's from one forward
    over each of its segments (the samples the recipe trains on; one segment here: history is kept)."""
    device = next(trainer.parameters()).device
    mismatched = 0
    for seg in ep.segments:
        with torch.no_grad():
            lp = trainer_patch.token_logprobs(trainer, torch.tensor([seg.context], device=device),
                                              temperature=TEMPERATURE)[0, len(seg.prompt_ids) - 1:]
        model = [(x, y) for x, y, m in zip(seg.logprobs, lp.tolist(), seg.model_mask) if m]
        mismatched += sum(bits([x]) != bits([y]) for x, y in model)
    return mismatched
