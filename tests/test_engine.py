"""Rollout engine: determinism audit, zero KL against the trainer, verifier guarantees, batching, errors."""
import dataclasses
import itertools
import random

import pytest
import torch

import trainer_patch
from rollout_service import Engine, InvalidRequestError, SamplingParams
from rollout_service.audit import run_audit
from rollout_service.engine.decode_policy import STRATEGIES, DecodePolicy
from rollout_service.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=7)


@pytest.fixture(scope="module")
def audit_results(model):
    make = lambda **kw: Engine(model, copy_model=False, **kw)  # noqa: E731
    return run_audit(make, model.config.vocab_size, max_tokens=10)


@pytest.mark.parametrize("mode", ["verified", "invariant"])
def test_audit_one_distinct_output_per_prompt(audit_results, mode):
    rows = [r for r in audit_results if r.mode == mode]
    assert {r.test for r in rows} == {"single", "mixed", "prefix"} and len(rows) == 6
    bad = [(r.test, r.sampling, r.max_distinct) for r in rows if not r.deterministic]
    assert not bad, f"{mode}: more than one distinct output: {bad}"


def test_audit_shows_off_mode_varies(audit_results):
    """`off` has no guarantee: the fast path's ordinary torch ops (GEMMs blocked by batch size, SDPA
    over a padded gather) give one prompt different bits in different batches. This is the audit's
    negative control: the same variations leave verified and invariant at one output."""
    rows = [r for r in audit_results if r.mode == "off"]
    assert len(rows) == 6
    single = [r for r in rows if r.test == "single"]  # one prompt in batches of 1, 4, 16 and 64
    assert all(r.max_distinct >= 2 for r in single), [(r.sampling, r.max_distinct) for r in single]


def _prompts(n, seed=0, vocab=96):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, -1), (0.7, 0.9, -1), (1.0, 1.0, 20)])
def test_zero_kl_against_trainer_and_verified_equals_invariant(model, temperature, top_p, top_k):
    prompts = _prompts(6, seed=1)
    engine = Engine(model, window=6, group=4)
    out = {}
    for mode in ("verified", "invariant", "off"):
        params = [SamplingParams(max_tokens=14, temperature=temperature, top_p=top_p, top_k=top_k, seed=50 + i,
                                 determinism=mode) for i in range(len(prompts))]
        out[mode] = engine.generate(prompts, params)
    t_eff = temperature if temperature > 0 else 1.0
    mismatched_off = 0
    for i, prompt in enumerate(prompts):
        v, inv = out["verified"][i], out["invariant"][i]
        assert v.token_ids == inv.token_ids and v.logprobs == inv.logprobs
        ids = torch.tensor([prompt + v.token_ids])
        train = trainer_patch.token_logprobs(model, ids, temperature=t_eff)[0, len(prompt) - 1:]
        assert torch.equal(train, torch.tensor(v.logprobs, dtype=torch.float32)), f"prompt {i}: KL != 0"
        off = out["off"][i]
        ids = torch.tensor([prompt + off.token_ids])
        train = trainer_patch.token_logprobs(model, ids, temperature=t_eff)[0, len(prompt) - 1:]
        mismatched_off += not torch.equal(train, torch.tensor(off.logprobs, dtype=torch.float32))
    # the un-fixed path is measurably not on-policy: its log-probs are the fast path's
    assert mismatched_off > 0


class CorruptingFastPath:
    """Wraps a fast path and replaces a random fraction of its proposals with random tokens."""
    name = "corrupting"

    def __init__(self, inner, fraction, vocab, seed=0):
        self.inner, self.fraction, self.vocab, self.rng = inner, fraction, vocab, random.Random(seed)

    def propose(self, batch):
        out = self.inner.propose(batch)
        for p in out:
            p.token_ids = [self.rng.randrange(self.vocab) if self.rng.random() < self.fraction else t
                           for t in p.token_ids]
        return out

    def release(self, rid):
        self.inner.release(rid)

    def update_weights(self, sd):
        pass


@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_verifier_guarantees_output_with_a_corrupting_fast_path(model, fraction):
    prompts = _prompts(5, seed=2)
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=7 + i) for i in range(5)]
    clean = Engine(model, window=5, group=2).generate(prompts, params)
    engine = Engine(model, window=5, group=2, verified_decode="dvr")
    engine.fast_path = CorruptingFastPath(engine.fast_path, fraction, 96)
    bad = engine.generate(prompts, params)
    for c, b in zip(clean, bad):
        assert (c.token_ids, c.logprobs, c.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
        assert len(b.token_ids) == 16  # forward progress: every window commits >= 1 token
    assert sum(b.stats.rollbacks for b in bad) > 0
    assert sum(b.stats.recomputed_tokens for b in bad) > 0
    # and without the verifier, corruption does change the output
    off_params = [SamplingParams(max_tokens=16, temperature=0.8, seed=7 + i, determinism="off") for i in range(5)]
    assert [r.token_ids for r in engine.generate(prompts, off_params)] != [c.token_ids for c in clean]


def test_mixed_modes_in_one_batch_and_off_pays_no_verification(model):
    prompts = _prompts(6, seed=3)
    modes = ["verified", "invariant", "off"] * 2
    params = [SamplingParams(max_tokens=10, temperature=0.7, seed=i, determinism=m) for i, m in enumerate(modes)]
    engine = Engine(model, window=4, group=3, verified_decode="dvr")
    mixed = engine.generate(prompts, params)
    for i, (p, prm) in enumerate(zip(prompts, params)):
        alone = engine.generate([p], [prm])[0]
        if prm.determinism != "off":
            assert (alone.token_ids, alone.logprobs) == (mixed[i].token_ids, mixed[i].logprobs)
        else:
            assert mixed[i].stats.verify_windows == 0 and mixed[i].stats.proposed_tokens == 0
    assert all(r.stats.verify_windows > 0 for r, m in zip(mixed, modes) if m == "verified")


def test_continuous_batching_with_a_tiny_kv_pool_preempts_and_gives_same_bits(model):
    prompts = _prompts(10, seed=4)
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=i) for i in range(10)]
    roomy = Engine(model, window=8, group=8).generate(prompts, params)
    tight = Engine(model, window=8, group=8, block_size=4, kv_cache_tokens=80, max_prefill_tokens=16)
    # requests join and leave between steps; the pool holds ~1-2 sequences at a time
    ids = [tight.add_request(p, prm) for p, prm in zip(prompts[:4], params[:4])]
    done = {}
    steps = 0
    while tight.has_unfinished():
        done.update(tight.step())
        steps += 1
        if steps == 3:
            ids += [tight.add_request(p, prm) for p, prm in zip(prompts[4:], params[4:])]
        assert tight.cache.free_blocks >= 0
    assert len(done) == 10
    for rid, r in zip(ids, roomy):
        assert (done[rid].token_ids, done[rid].logprobs) == (r.token_ids, r.logprobs)


def test_stop_tokens_and_lengths(model):
    engine = Engine(model, window=4)
    free = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    r = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))[0]
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[:first + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 12


def test_bad_requests_get_error_results_and_others_are_served(model):
    engine = Engine(model, kv_cache_tokens=256, max_model_len=128)
    good = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = [[1, 2], [], [5, 999], [1] * 200, [3, 4], [1] * 100, "abc"]
    params = [good, good, good, good, SamplingParams(max_tokens=4, temperature=0.0), SamplingParams(max_tokens=400, temperature=0.0), good]
    out = engine.generate(prompts, params)
    assert [r.finish_reason for r in out] == ["length", "error", "error", "error", "length", "error", "error"]
    assert "empty" in out[1].error and "outside" in out[2].error and "max_model_len" in out[3].error
    assert "exceeds max_model_len 128" in out[5].error  # refused, not cut short
    small_cache = Engine(model, kv_cache_tokens=64, max_model_len=128)
    [r] = small_cache.generate([[1] * 10], SamplingParams(max_tokens=100, temperature=0.0))
    assert r.finish_reason == "error" and "never fit" in r.error
    with pytest.raises(InvalidRequestError):
        engine.add_request([1, 2], "not params")


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=3, temperature=-1), "temperature"),
    (dict(max_tokens=3, top_p=0.0), "top_p"), (dict(max_tokens=3, top_k=-5), "top_k"),
    (dict(max_tokens=3, temperature=0.7), "needs a seed"), (dict(max_tokens=3, determinism="fast"), "determinism"),
    (dict(max_tokens=3, temperature=float("nan")), "temperature")])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_abort_and_unknown_model(tmp_path, model):
    engine = Engine(model)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    assert engine.abort(rid)
    (got_id, r), = engine.step()
    assert got_id == rid and r.finish_reason == "abort"
    with pytest.raises(FileNotFoundError):
        Engine(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="fast_path"):
        Engine(model, fast_path="turbo")


def test_model_names_mean_the_same_everywhere():
    """"tiny:<arch>" is a model name for Engine as for `zerokl audit` (one resolver: load_model)."""
    prompts, params = [[4, 5, 6]], SamplingParams(max_tokens=6, temperature=0.7, seed=3)
    by_name = Engine("tiny:qwen2").generate(prompts, params)[0]
    by_object = Engine(tiny_model("qwen2")).generate(prompts, params)[0]
    assert by_name.token_ids == by_object.token_ids and by_name.logprobs == by_object.logprobs
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt2'"):
        Engine("tiny:gpt2")
    with pytest.raises(FileNotFoundError, match="tiny:<llama|qwen2|qwen3>"):
        Engine("no/such/checkpoint")
    with pytest.raises(TypeError, match="local path"):
        Engine(42)


def test_prompts_are_any_integer_sequence_and_floats_or_bools_are_refused(model):
    np = pytest.importorskip("numpy")
    engine = Engine(model)
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=11)
    ids = [7, 3, 19, 4]
    want = engine.generate([ids], params)[0]
    for same in (np.array(ids), np.array(ids, dtype=np.int32), [np.int64(t) for t in ids], tuple(ids),
                 torch.tensor(ids), torch.tensor(ids, dtype=torch.int32)):
        got = engine.generate([same], params)[0]
        assert got.ok and got.token_ids == want.token_ids and got.logprobs == want.logprobs, type(same)
    bad = [np.array(ids, dtype=np.float32), [7.0, 3, 19], [True, 3], np.array([1, 0], dtype=bool),
           torch.tensor([1.0, 2.0]), "7 3 19", 7, [[7, 3]]]
    for prompt in bad:
        with pytest.raises(InvalidRequestError, match="token ids"):
            engine.add_request(prompt, params)
    out = engine.generate([ids, bad[0], ids], params)  # a bad prompt fails alone; the others are served
    assert [r.finish_reason for r in out] == ["length", "error", "length"] and out[2].token_ids == want.token_ids


def test_unseeded_off_requests_draw_fresh_seeds(model):
    """As in vLLM: n samples of one prompt without a seed differ; seeded ones repeat exactly."""
    engine = Engine(model)
    unseeded = SamplingParams(max_tokens=8, temperature=1.0, determinism="off")
    outs = engine.generate([[5, 6, 7]] * 6, unseeded)
    assert len({tuple(r.token_ids) for r in outs}) >= 2
    seeded = dataclasses.replace(unseeded, seed=5)
    outs = engine.generate([[5, 6, 7]] * 3, seeded)
    assert len({tuple(r.token_ids) for r in outs}) == 1


def test_engine_loads_a_saved_checkpoint_and_updates_weights(tmp_path, model):
    model.save_pretrained(tmp_path)
    prompts, params = [[4, 5, 6]], SamplingParams(max_tokens=6, temperature=0.0)
    from_path = Engine(str(tmp_path)).generate(prompts, params)
    assert from_path[0].token_ids == Engine(model).generate(prompts, params)[0].token_ids
    other = tiny_model("qwen2", seed=99)
    engine = Engine(model)
    from rollout_service.weights import state_dict_digest
    assert engine.update_weights(other.state_dict()) == state_dict_digest(other.state_dict())
    assert engine.generate(prompts, params)[0].token_ids == Engine(other).generate(prompts, params)[0].token_ids


def test_no_livelock_when_a_young_prefill_cannot_get_blocks(model):
    """Older decoding requests hold the pool; a younger one needing prefill must wait, not stall."""
    engine = Engine(model, window=4, group=4, block_size=4, kv_cache_tokens=64)
    old = [engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=24, temperature=0.0)) for _ in range(2)]
    engine.step()  # prefill the old ones
    # two young prompts admitted in the same step, only one of which fits next to the old ones
    young = {engine.add_request(list(range(10 + i, 40 + i)), SamplingParams(max_tokens=4, temperature=0.0))
             for i in range(2)}
    done, steps = {}, 0
    while engine.has_unfinished():
        done.update(engine.step())
        steps += 1
        assert steps < 500, "engine made no progress"
    assert set(done) == set(old) | young and all(r.ok for r in done.values())


def test_native_proposals_equal_host_fed_steps(model):
    """The fast path feeds sampled tokens back on the device (no per-step readback); its proposals
    equal stepping the same runner with host token ids, live sets shrinking as requests run out."""
    from rollout_service.engine.fast_path.base import DraftRequest
    from rollout_service.engine.sampler import sample_rows
    from rollout_service.engine.runner import Chunk
    engine = Engine(model, window=6, group=4, copy_model=False)
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(max_tokens=8, temperature=t, seed=11 + i) for i, t in enumerate((0.0, 0.7, 1.0, 1.3))]
    counts = [6, 2, 5, 1]
    blocks = []
    for p in prompts:  # prompts' KV from a canonical prefill, then drafts on top
        ids: list[int] = []
        engine.cache.ensure(ids, len(p) + 8)
        blocks.append(ids)
    engine.canonical_runner.forward([Chunk(p, 0, b, 0) for p, b in zip(prompts, blocks)])
    drafts = [DraftRequest(i, list(p), params[i], counts[i], blocks[i], len(p)) for i, p in enumerate(prompts)]
    got = engine.fast_path.propose(drafts)
    runner = engine.fast_path.runner
    want = [list(p) for p in prompts]
    for step in range(max(counts)):
        live = [i for i in range(4) if counts[i] > step]
        logits = torch.cat(runner.forward([Chunk([want[i][-1]], len(want[i]) - 1, blocks[i], 1) for i in live]))
        toks = sample_rows(logits, [params[i] for i in live], [len(want[i]) for i in live]).tolist()
        for i, t in zip(live, toks):
            want[i].append(t)
    assert [g.token_ids for g in got] == [w[len(p):] for w, p in zip(want, prompts)]
    assert [len(g.logprobs) for g in got] == counts


class AlternatingPolicy(DecodePolicy):
    """Switches verified requests between DVR and canonical steps every decode step."""

    def __init__(self):
        super().__init__("auto")
        self._next = itertools.cycle(STRATEGIES)

    def choose(self, batch):
        return next(self._next)


def test_verified_decode_strategies_commit_the_same_bits(model):
    """DVR (with a fast path that corrupts half its proposals), canonical steps, the measuring `auto`
    policy, a policy that switches strategy every step, and `invariant` all commit the same tokens and
    log-probs; the corrupted proposals do reach `off`."""
    prompts = _prompts(7, seed=5)
    params = [SamplingParams(max_tokens=15, temperature=0.9, seed=30 + i) for i in range(len(prompts))]
    out = {}
    for name in ("dvr", "canonical", "auto", "alternating"):
        engine = Engine(model, window=4, group=3, verified_decode="dvr" if name == "dvr" else "auto")
        engine.fast_path = CorruptingFastPath(engine.fast_path, 0.5, 96, seed=1)
        if name in ("canonical", "alternating"):  # a fixed canonical policy, or one that switches every step
            engine.decode_policy = DecodePolicy("canonical") if name == "canonical" else AlternatingPolicy()
        out[name] = engine.generate(prompts, params)
    out["invariant"] = engine.generate(prompts, [dataclasses.replace(p, determinism="invariant") for p in params])
    bits = {name: [(r.token_ids, r.logprobs, r.finish_reason) for r in rs] for name, rs in out.items()}
    assert all(b == bits["dvr"] for b in bits.values()), {n: b == bits["dvr"] for n, b in bits.items()}
    assert sum(r.stats.rollbacks for r in out["dvr"]) > 0 and sum(r.stats.rollbacks for r in out["alternating"]) > 0
    assert all(r.stats.verify_windows == 0 for r in out["canonical"] + out["invariant"])
    off = engine.generate(prompts, [dataclasses.replace(p, determinism="off") for p in params])
    assert [r.token_ids for r in off] != [t for t, _, _ in bits["dvr"]]


def test_decode_policy_keeps_the_faster_strategy_and_retries_the_other():
    policy = DecodePolicy("auto", retry_every=4, explore=2)
    with pytest.raises(ValueError, match="verified_decode"):
        DecodePolicy("sometimes")
    with pytest.raises(ValueError, match="explore"):
        DecodePolicy("auto", explore=0)
    assert DecodePolicy("dvr").choose(64) == "dvr" and DecodePolicy("canonical").choose(64) == "canonical"
    # explore: each strategy runs until it has 2 timed steps; the first step of each is not timed
    seen = []
    for _ in range(6):
        s = policy.choose(60)
        seen.append(s)
        policy.record(60, s, tokens=64 * 8, seconds=1.0 if s == "dvr" else 0.5)  # canonical: 2x faster
    assert seen == ["dvr"] * 3 + ["canonical"] * 3
    assert policy.rates() == {"canonical@64": 1024.0, "dvr@64": 512.0}
    choices = [policy.choose(64) for _ in range(28)]  # bucket 64 holds 33..64
    # DVR is retried after 4 choices, then 8, then 16: each retry that keeps the leader doubles the wait
    assert [i + 1 for i, c in enumerate(choices) if c == "dvr"] == [4, 12, 28]
    # a rate is tokens over time: a DVR step that rolled back early (few tokens) counts for little
    policy.record(64, "dvr", tokens=8, seconds=0.01)
    assert policy.choose(64) == "canonical"
    for _ in range(6):  # DVR gets faster (e.g. contexts grew) and takes over
        policy.record(64, "dvr", tokens=64 * 8, seconds=0.1)
    # a new leader: canonical steps are retried every 4th choice again
    assert [policy.choose(64) for _ in range(4)] == ["dvr"] * 3 + ["canonical"]
    # a new bucket next to a measured one starts with its leader (DVR by now) and runs canonical steps
    # only at its retries, not through a full exploration of its own
    seen = []
    for _ in range(7):  # bucket 128 holds 65..128
        s = policy.choose(100)
        seen.append(s)
        policy.record(100, s, tokens=64 * 8, seconds=0.1 if s == "dvr" else 0.5)
    assert seen == ["dvr"] * 6 + ["canonical"]
    assert "canonical@128" not in policy.rates()  # its first step paid the compiles: not timed yet


def test_decode_policy_leaves_out_a_stalled_step():
    # canonical is 2x faster, but one of its two timed exploration steps stalls (10x, e.g. a compile):
    # counted, that stall alone makes DVR look faster until the first retry
    policy = DecodePolicy("auto", retry_every=16, explore=2)
    stalls = iter([False, True, False])
    for _ in range(6):
        s = policy.choose(64)
        slow = s == "canonical" and next(stalls)
        policy.record(64, s, tokens=512, seconds=1.0 if s == "dvr" else 5.0 if slow else 0.5)
    assert policy.rates() == {"canonical@64": 1024.0, "dvr@64": 512.0}
    assert [policy.choose(64) for _ in range(8)] == ["canonical"] * 8
    # a lasting slowdown is not an outlier: once it is the typical step it counts, and DVR leads
    for _ in range(4):
        policy.record(64, "canonical", tokens=512, seconds=5.0)
    assert policy.choose(64) == "dvr"
