"""Weights that change while requests run, in the native engine: every generated token carries the
version of the weights that produced it (Rollout.weight_versions), and its log-prob is the trainer's
under that version over the whole prefix, because the running requests' KV is computed again under
the new weights before their next token. Both policies are checkpoints on disk, loaded the usual way
on the trainer's side.

Controls: scoring the mixed-version tokens with the latest weights alone differs, and an engine that
keeps the old KV across the switch reports log-probs that are not the trainer's under either version.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

import trainer_patch
from rollout_service import Engine, SamplingParams
from rollout_service.engine.scheduler import Scheduler

TEMPERATURE = 1.0
NEW_VERSION = 7


@pytest.fixture(scope="module")
def checkpoints(policy_checkpoints):
    return policy_checkpoints[:2]


def _trainer(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def _trainer_logprobs(model, rollout) -> list[float]:
    ids = torch.tensor([rollout.prompt_token_ids + rollout.token_ids])
    return trainer_patch.token_logprobs(model, ids, temperature=TEMPERATURE)[0, -len(rollout.token_ids):].tolist()


def _run_with_a_switch(old_path, new_path, refused_first: bool = False):
    """Four requests; once each has generated a token or more (and none is finished), the weights
    switch to `new_path`'s; the rollouts in request order."""
    engine = Engine(str(old_path), fast_path="native", window=4, group=4, device="cpu")
    prompts = [[3 + i, 17, 40 + 5 * i] for i in range(4)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=14, temperature=TEMPERATURE, seed=900 + i))
           for i, p in enumerate(prompts)]
    done = {}
    while not engine.scheduler.running or min(r.num_generated for r in engine.scheduler.running) == 0:
        done.update(engine.step())
    assert not done and all(r.remaining > 0 for r in engine.scheduler.running)
    new = _trainer(new_path).state_dict()
    if refused_first:  # a refused push changes nothing: weights, version and the requests' KV stay
        with pytest.raises(TypeError, match="version"):
            engine.update_weights(new, version="7")
        assert engine.weight_version == 0 and all(r.num_cached > 0 for r in engine.scheduler.running)
    engine.update_weights(new, version=NEW_VERSION)
    assert engine.weight_version == NEW_VERSION
    while engine.has_unfinished():
        done.update(engine.step())
    return [done[i] for i in ids]


def test_tokens_after_a_switch_are_the_trainers_under_their_version(checkpoints):
    old_path, new_path = checkpoints
    rollouts = _run_with_a_switch(old_path, new_path, refused_first=True)
    old, new = _trainer(old_path), _trainer(new_path)
    for r in rollouts:
        assert r.ok and len(r.weight_versions) == len(r.token_ids) == 14
        switch = r.weight_versions.index(NEW_VERSION)
        assert 0 < switch and r.weight_versions == [0] * switch + [NEW_VERSION] * (14 - switch)
        under_old, under_new = _trainer_logprobs(old, r), _trainer_logprobs(new, r)
        expected = under_old[:switch] + under_new[switch:]
        assert r.logprobs == expected  # bit for bit, each token under its own version
        assert r.logprobs[:switch] != under_new[:switch]  # control: the latest weights alone differ


def test_old_kv_across_a_switch_is_not_the_trainers(checkpoints, monkeypatch):
    """The control for the recompute: with the KV kept, tokens after the switch attend to keys and
    values of the old weights, and their log-probs match the trainer under neither version."""
    old_path, new_path = checkpoints
    monkeypatch.setattr(Scheduler, "drop_all_kv", lambda self: None)
    rollouts = _run_with_a_switch(old_path, new_path)
    new = _trainer(new_path)
    stale = 0
    for r in rollouts:
        switch = r.weight_versions.index(NEW_VERSION)
        stale += r.logprobs[switch:] != _trainer_logprobs(new, r)[switch:]
    assert stale == len(rollouts)


def test_an_engine_that_never_switches_stamps_version_0(checkpoints):
    engine = Engine(str(checkpoints[0]), fast_path="native", window=4, group=4, device="cpu")
    [r] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=TEMPERATURE, seed=3))
    assert r.weight_versions == [0] * 6
