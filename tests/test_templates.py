"""Chat templates that keep history and templates that rewrite it (recipes/episodes.py, tests/template_shared.py),
on the native engine with a tiny model saved to disk: every model token of every turn reports the log-prob
the trainer gets scoring its training sample in one forward, bit for bit. Where the template keeps history
an episode is one concatenated trajectory; where it drops earlier think blocks, a segment per rewrite, each
scored after the context its turns saw. The control: scoring the final rendered conversation, as a trainer
that renders conversations would, is right where history is kept and wrong for the rewritten turns."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from episodes_shared import bits, trainer_bits

import trainer_patch
from packing_shared import score
from recipes.batch import Sample, pack, pack_flat
from recipes.environment import EnvStep
from recipes.episodes import episode_metrics, episode_of, episode_rollouts, run_episodes
from recipes.grpo_loss import group_advantages
from rollout_service import Engine, SamplingParams
from rollout_service.tiny_models import tiny_model
from template_shared import TEMPLATES, WORDS, ChatEnv, save_tokenizer

TURNS, MAX_TOKENS, MAX_MODEL_LEN = 4, 6, 160


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {kind: save_tokenizer(tmp_path_factory.mktemp(kind), template) for kind, template in TEMPLATES.items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizers):
    path = tmp_path_factory.mktemp("templates-model")
    vocab = {len(tok) for tok in tokenizers.values()}.pop()
    tiny_model("qwen2", seed=11, vocab_size=vocab).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine(str(checkpoint))


@pytest.fixture(scope="module")
def trainer(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def _rows(n: int, seed: int = 0) -> list[dict]:
    """User messages of 2 to 5 words."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 6, (n,), generator=g).tolist()
    return [{"text": " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist())}
            for k in lengths]


def _run(engine, envs, rows, determinism="verified"):
    """The episodes, and per episode each turn's request: (prompt, rollout)."""
    eos = envs[0].eos
    requests: list[list[tuple[list[int], object]]] = [[] for _ in rows]

    def params_for(e: int, turn: int, room: int) -> SamplingParams:
        return SamplingParams(max_tokens=min(MAX_TOKENS, room), temperature=1.0, seed=1000 * e + turn,
                              stop_token_ids=(eos,), determinism=determinism)

    def generate(prompts, params):
        out = engine.generate(prompts, params)
        for prompt, p, rollout in zip(prompts, params, out):
            requests[p.seed // 1000].append((list(prompt), rollout))
        return out

    episodes = run_episodes(envs, rows, generate, params_for, max_turns=TURNS + 1, max_model_len=MAX_MODEL_LEN)
    return episodes, requests


def _whole(kind: str) -> bool:
    """The environment of a template that keeps history observes deltas; of one that rewrites, contexts."""
    return kind == "drop_think"


@pytest.mark.parametrize("kind", TEMPLATES)
def test_every_turn_is_trained_after_the_context_it_saw(engine, trainer, tokenizers, kind):
    rows = _rows(6)
    envs = [ChatEnv(tokenizers[kind], whole_context=_whole(kind), turns=TURNS) for _ in rows]
    episodes, requests = _run(engine, envs, rows)
    for ep, env, turns in zip(episodes, envs, requests):
        assert ep.end == "done" and ep.turns == TURNS
        # one trajectory where history is kept; where think blocks are dropped, a rewrite at every user
        # message after the first (the turns before it lose their <think>), a continuation at tool messages
        users = sum(m["role"] == "user" for m in env.messages[1:])
        assert users > 0
        assert len(ep.segments) == (1 + users if kind == "drop_think" else 1)
        # each turn's request is the template's render of the conversation so far ...
        assert [prompt for prompt, _ in turns] == env.renders
        # ... and its segment holds that very context, then the turn's tokens as sampled, in the loss
        of_turn = [seg for seg in ep.segments for _ in range(seg.turns)]
        for seg, (prompt, rollout) in zip(of_turn, turns, strict=True):
            assert prompt[:len(seg.prompt_ids)] == seg.prompt_ids and seg.context[:len(prompt)] == prompt
            at = len(prompt) - len(seg.prompt_ids)
            span = slice(at, at + len(rollout.token_ids))
            assert seg.token_ids[span] == rollout.token_ids and all(seg.model_mask[span])
            assert bits(seg.logprobs[span]) == bits(rollout.logprobs)
        firsts = [sum(s.turns for s in ep.segments[:k]) for k in range(len(ep.segments))]
        assert [seg.prompt_ids for seg in ep.segments] == [turns[i][0] for i in firsts]
        for seg in ep.segments:
            # the trainer, one forward per segment: every model token's log-prob as its turn reported it
            assert bits(x for x, m in zip(seg.logprobs, seg.model_mask) if m) == trainer_bits(trainer, seg)
            sample = Sample(seg.prompt_ids, seg.token_ids, seg.logprobs, 1.0, model_mask=seg.model_mask)
            p = len(seg.prompt_ids)
            for packed in (pack([sample])["loss_mask"][0], pack_flat([sample])["loss_mask"][0]):
                assert packed[p - 1:p - 1 + len(seg.token_ids)].tolist() == seg.model_mask
                assert int(packed.sum()) == sum(seg.model_mask)
        assert sum(sum(seg.model_mask) for seg in ep.segments) == sum(map(len, env.sampled))
        assert not all(m for seg in ep.segments for m in seg.model_mask)  # observations, masked out


def _assistant_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of each run of 1s: one per assistant message."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("kind", TEMPLATES)
def test_scoring_the_final_render_is_right_only_where_history_is_kept(engine, trainer, tokenizers, kind):
    """The naive trainer: render the finished conversation once, score it in one forward, read each assistant
    message's tokens ({% generation %}). Where history is kept that is each turn's context and log-probs,
    bit for bit; where the template dropped a turn's think block, the turn's tokens are missing or scored
    after another context (its own <think> is gone), and the log-probs are not the rollout's."""
    tok = tokenizers[kind]
    rows = _rows(6, seed=1)
    envs = [ChatEnv(tok, whole_context=_whole(kind), turns=TURNS) for _ in rows]
    episodes, requests = _run(engine, envs, rows)
    judged = {True: 0, False: 0}
    for ep, env, turns in zip(episodes, envs, requests):
        full = tok.apply_chat_template(env.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, runs = full["input_ids"], _assistant_runs(full["assistant_masks"])
        assistant = [i for i, m in enumerate(env.messages) if m["role"] == "assistant"]
        assert len(runs) == len(assistant) == len(turns) == TURNS
        last_user = max(i for i, m in enumerate(env.messages) if m["role"] == "user")
        with torch.no_grad():
            lp = trainer_patch.token_logprobs(trainer, torch.tensor([ids]))[0].tolist()
        for (start, stop), index, (_, rollout) in zip(runs, assistant, turns):
            sampled = rollout.token_ids
            content = len(sampled) - (sampled[-1:] == [env.eos])  # the template writes the <eos> itself
            if content == 0:
                continue  # nothing of the turn to score but its <eos>
            rendered = ids[start:stop - 1]
            naive_right = (rendered == sampled[:content]
                           and bits(lp[start - 1:stop - 2]) == bits(rollout.logprobs[:content]))
            rewritten = kind == "drop_think" and index < last_user
            assert naive_right == (not rewritten), (kind, index, last_user)
            judged[rewritten] += 1
    assert judged[False] > 0
    assert (judged[True] > 0) == (kind == "drop_think")


def test_a_whole_context_that_extends_is_its_delta(engine, tokenizers):
    """The template that keeps history, its environment giving whole contexts: they extend the trajectory
    exactly, so the episodes are the ones its deltas give, one segment each, the same ids and bits."""
    tok, rows = tokenizers["keep_history"], _rows(4, seed=2)
    runs = [_run(engine, [ChatEnv(tok, whole_context=whole, turns=TURNS) for _ in rows], rows)[0]
            for whole in (False, True)]
    for delta, whole in zip(*runs):
        (a,), (b,) = delta.segments, whole.segments
        assert (a.prompt_ids, a.token_ids, a.model_mask) == (b.prompt_ids, b.token_ids, b.model_mask)
        assert bits(a.logprobs) == bits(b.logprobs) and delta.reward == whole.reward


class _Rewrites(ChatEnv):
    """A ChatEnv whose steps that go on are turned into another EnvStep by `make`."""

    def __init__(self, tokenizer, make):
        super().__init__(tokenizer, whole_context=True, turns=TURNS)
        self.make = make

    def step(self, model_tokens):
        step = super().step(model_tokens)
        return step if step.done else self.make(step)


@pytest.mark.parametrize("make, reason", [
    (lambda s: EnvStep(observation=s.context[-1:], context=s.context, reward=s.reward),
     "environment error: ValueError: an EnvStep gives an observation (1 tokens) or a whole context"),
    (lambda s: EnvStep(context=[], reward=s.reward), "environment error: ValueError: an EnvStep's context is empty"),
    (lambda s: EnvStep(context=s.context * (MAX_MODEL_LEN // len(s.context) + 1), reward=s.reward),
     "context overflows max_model_len: the next turn's context holds")])
def test_a_bad_next_context_ends_its_episode_with_a_reason(engine, tokenizers, make, reason):
    tok, rows = tokenizers["drop_think"], _rows(3, seed=3)
    envs = [ChatEnv(tok, whole_context=True, turns=TURNS), _Rewrites(tok, make), ChatEnv(tok, True, turns=TURNS)]
    episodes, _ = _run(engine, envs, rows)
    assert [ep.end for ep in episodes][::2] == ["done", "done"]
    bad = episodes[1]
    assert bad.end.startswith(reason) and bad.turns == 1 and len(bad.segments) == 1
    # a step that could not be built earns nothing; one that overflows keeps its reward, as an observation's does
    kept = reason.startswith("context overflows")
    assert bad.reward == (envs[1].reward_of(envs[1].sampled[0]) if kept else 0.0)


def test_a_template_that_rewrites_has_no_delta(engine, tokenizers):
    """Asked for deltas, the rewriting template's environment fails at the first user message; recorded."""
    tok, rows = tokenizers["drop_think"], _rows(2, seed=4)
    episodes, _ = _run(engine, [ChatEnv(tok, whole_context=False, turns=TURNS) for _ in rows], rows)
    assert all(ep.end == "environment error: ValueError: the template rewrote history: it has no delta to observe"
               for ep in episodes)


def test_segments_reach_the_trainer_with_their_episodes_advantage(engine, trainer, tokenizers):
    """recipes/grpo_job's samples: one per segment, each with its episode's reward and advantage (groups: the
    n episodes of a prompt), mini-batches of whole prompt groups, the observations out of the loss mask,
    and the trainer's packed forward giving each model token its rollout log-prob."""
    from recipes import grpo_job
    n, prompts_rows = 3, _rows(2, seed=5)
    rows = [row for row in prompts_rows for _ in range(n)]
    tok = tokenizers["drop_think"]
    # the second prompt's episodes end before its user message: one segment each, so groups differ in size
    turns = [TURNS, 2]
    envs = [ChatEnv(tok, whole_context=True, turns=turns[i // n]) for i in range(len(rows))]
    episodes, _ = _run(engine, envs, rows)
    rollouts = episode_rollouts(episodes)
    prompts = [ro.prompt_token_ids for ro in rollouts]
    rewards, samples = grpo_job._score(None, prompts_rows, prompts, rollouts, n, scale=True)
    per_episode = torch.tensor([ep.reward for ep in episodes]).tolist()  # the recipe's rewards are float32
    assert rewards.view(-1).tolist() == per_episode
    advantages = group_advantages(rewards, scale=True).view(-1).tolist()
    assert any(a != 0.0 for a in advantages)
    episode = episode_of(rollouts)
    assert len(samples) == sum(len(ep.segments) for ep in episodes) > len(episodes)
    assert [s.advantage for s in samples] == [advantages[e] for e in episode]
    assert grpo_job._rollout_rewards(rollouts, rewards) == [per_episode[e] for e in episode]
    for s, ro in zip(samples, rollouts):
        assert (s.prompt_ids, s.token_ids, s.model_mask) == (ro.prompt_token_ids, ro.token_ids, ro.model_mask)
    metrics = episode_metrics(rollouts)
    assert metrics["episode/segments_mean"] == len(samples) / len(episodes)
    assert metrics["episode/turns_mean"] == sum(turns) / len(turns)

    sizes = grpo_job._group_sizes(rollouts, n)
    assert sizes == [sum(e // n == p for e in episode) for p in range(len(prompts_rows))]
    assert len(set(sizes)) > 1
    for packed in (False, True):
        cfg = SimpleNamespace(num_ranks=1, batching=SimpleNamespace(
            mini_batches=len(prompts_rows), micro_batch_size=0, max_tokens_per_micro_batch=0, packing=packed))
        plans, tokens = grpo_job._rank_plans(samples, cfg, tok.pad_token_id, sizes)
        start = 0
        for size, (mb,), count in zip(sizes, plans[0], tokens, strict=True):  # one micro-batch a mini-batch
            group = samples[start:start + size]
            start += size
            assert count == sum(len(s.token_ids) for s in group)
            mask = mb["loss_mask"]
            assert int(mask.sum()) == sum(sum(s.model_mask) for s in group)
            expected_adv = [a for s in group for a, m in zip([s.advantage] * len(s.token_ids), s.model_mask) if m]
            assert mb["advantages"][mask].tolist() == expected_adv
            with torch.no_grad():
                logp = score(trainer, mb)
            assert bits(logp[mask].tolist()) == bits(mb["rollout_logprobs"][mask].tolist())
            assert bits(mb["rollout_logprobs"][mask].tolist()) == bits(
                x for s in group for x, m in zip(s.logprobs, s.model_mask) if m)


def test_rollouts_out_of_episode_order_are_refused(engine, tokenizers):
    tok, rows = tokenizers["drop_think"], _rows(2, seed=6)
    episodes, _ = _run(engine, [ChatEnv(tok, whole_context=True, turns=TURNS) for _ in rows], rows)
    rollouts = episode_rollouts(episodes)
    assert episode_of(rollouts) == [e for e, ep in enumerate(episodes) for _ in ep.segments]
    with pytest.raises(ValueError, match="out of episode order"):
        episode_of(rollouts[1:] + rollouts[:1])
