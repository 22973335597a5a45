"""vLLM's own engine running the canonical forward (rollout_service.vllm.plugin): every generated
token's log-prob equals trainer_patch.token_logprobs on the same checkpoint bit for bit, and the
tokens equal the native Engine's for the same seeds, across batch compositions, chunked prefill and
prefix-cache hits. A stock vLLM model class with the same sampling processor does not match.

Runs wherever `import vllm` works (the CPU build in CI). One plugin LLM serves the Qwen2 tests; the
Llama / Qwen3 and negative-control cases build one more each.
"""
import gc
import os
import random

import pytest
import torch

pytest.importorskip("vllm")

from rollout_service import Engine, SamplingParams  # noqa: E402
from rollout_service.vllm.instance import WORKER_EXTENSION  # noqa: E402
from rollout_service.vllm.plugin.sampling import PROCESSOR_FQCN  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.vllm.plugin import HF_OVERRIDES, register  # noqa: E402
from rollout_service.vllm.requests import completion_tokens  # noqa: E402
from vllm_shared import (assert_matches_trainer, count_trainer_mismatches, random_prompts, trainer_logprobs,  # noqa: E402
                         vllm_generate)

# head_dim 32: the stock CPU attention (negative control) supports head sizes 32, 64, ... (not 16)
MODEL_KW = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
VOCAB = 96
MAX_BATCHED = 48  # prompts longer than this are prefilled in chunks
LLM_OPTIONS = dict(dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=True,
                   logits_processors=[PROCESSOR_FQCN], logprobs_mode="processed_logits", enforce_eager=True,
                   block_size=16, kv_cache_memory_bytes=64 << 20, max_model_len=256,
                   max_num_batched_tokens=MAX_BATCHED, max_num_seqs=8, distributed_executor_backend="uni", seed=0,
                   worker_extension_cls=WORKER_EXTENSION)
SAMPLINGS = {"greedy": dict(temperature=0.0), "T=0.7": dict(temperature=0.7),
             "T=1,top_k=5,top_p=0.9": dict(temperature=1.0, top_k=5, top_p=0.9)}


def _prompts(n, seed=0, lo=1, hi=40):
    return random_prompts(n, VOCAB, seed, lo, hi)


def _params(n, sampling, max_tokens, seed0=1000):
    return [SamplingParams(max_tokens=max_tokens, seed=seed0 + i, **SAMPLINGS[sampling]) for i in range(n)]


def make_llm(path, plugin=True, **options):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    gc.collect()  # an unreferenced in-process engine tears down vLLM's parallel state when collected: before ours
    register()  # vLLM calls it through the entry point too (test_entry_point_is_installed)
    from vllm import LLM
    # the stock CPU attention needs blocks of a multiple of 32 tokens
    extra = dict(hf_overrides=HF_OVERRIDES) if plugin else dict(block_size=32)
    return LLM(model=path, **{**LLM_OPTIONS, **extra, **options})


def close(llm):
    del llm
    gc.collect()


def _checkpoint(tmp_path_factory, arch, seed):
    """A tiny checkpoint; "<arch>-tied" shares lm_head with the embedding (saved without lm_head.weight)."""
    path = str(tmp_path_factory.mktemp(f"zerokl-{arch}"))
    model = tiny_model(arch.removesuffix("-tied"), seed=seed, **MODEL_KW)
    if arch.endswith("-tied"):
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(path)
    return path


def test_entry_point_is_installed():
    from rollout_service.vllm.plugin import require_entry_point
    require_entry_point()  # raises if the package is not installed


def test_processes_of_vllm_need_the_entry_point(monkeypatch):
    """Without the entry point, an engine whose model vLLM's own processes build (tensor parallel
    workers, an engine core of its own) is refused before any process starts; vLLM left to itself
    hangs, the other ranks waiting for the one that cannot build the model."""
    import importlib.metadata
    from rollout_service.vllm import plugin as vllm_plugin
    from rollout_service.vllm.instance import VLLMInstance
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    with pytest.raises(RuntimeError, match="entry point"):
        vllm_plugin.require_entry_point()
    with pytest.raises(RuntimeError, match="entry point"):
        vllm_plugin.llm_options(None, tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match="entry point"):
        VLLMInstance("/nonexistent", hf_overrides=dict(vllm_plugin.HF_OVERRIDES), in_process=False)
    assert vllm_plugin.llm_options(None)["hf_overrides"] == vllm_plugin.HF_OVERRIDES  # in-process, one rank


def test_vllm_plugins_allow_list_must_name_the_plugin(monkeypatch):
    from rollout_service.vllm.plugin import require_entry_point
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(RuntimeError, match="VLLM_PLUGINS"):
        require_entry_point()
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,zerokl")
    require_entry_point()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "qwen2", seed=7)


@pytest.fixture(scope="module")
def policy(checkpoint):
    """The trainer's side: the checkpoint loaded the usual way."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def llm(checkpoint):
    llm = make_llm(checkpoint)
    yield llm
    close(llm)


@pytest.fixture(scope="module")
def native(checkpoint):
    return Engine(checkpoint, window=4, group=4)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_matches_trainer_and_native_engine(llm, policy, native, sampling):
    prompts = _prompts(5, seed=1) + _prompts(1, seed=2, lo=70, hi=90)  # the last one is chunked
    params = _params(len(prompts), sampling, max_tokens=8)
    results = vllm_generate(llm, prompts, params)
    assert_matches_trainer(policy, prompts, params, results)
    rollouts = native.generate(prompts, params)
    assert [r.token_ids for r in rollouts] == [tokens for tokens, _, _ in results]
    assert [r.logprobs for r in rollouts] == [logprobs for _, logprobs, _ in results]


def test_batch_compositions_are_bitwise_equal(llm, policy):
    prompts = _prompts(6, seed=3, hi=30) + _prompts(1, seed=4, lo=60, hi=60)
    params = _params(len(prompts), "T=0.7", max_tokens=6, seed0=50)
    together = vllm_generate(llm, prompts, params)
    assert_matches_trainer(policy, prompts, params, together)
    alone = [vllm_generate(llm, [p], [s])[0] for p, s in zip(prompts, params)]
    order = [6, 2, 5, 0, 3, 1, 4]
    shuffled = vllm_generate(llm, [prompts[i] for i in order], [params[i] for i in order])
    others = _prompts(5, seed=5, lo=20, hi=70)  # unrelated neighbours, mixed prefill / decode steps
    mixed = vllm_generate(llm, others[:3] + prompts[:4] + others[3:] + prompts[4:],
                          _params(3, "greedy", 9) + params[:4] + _params(2, "T=0.7", 3, seed0=9) + params[4:])
    mixed = mixed[3:7] + mixed[9:]

    def strip(rs):  # compare tokens and log-probs (cache hits differ between the runs)
        return [r[:2] for r in rs]
    assert strip(alone) == strip(together)
    assert strip([shuffled[order.index(i)] for i in range(len(prompts))]) == strip(together)
    assert strip(mixed) == strip(together)


def test_chunked_prefill_and_prefix_cache_hits(llm, policy):
    rng = random.Random(6)
    shared = [rng.randrange(VOCAB) for _ in range(100)]  # > MAX_BATCHED: prefilled in chunks
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    params = _params(len(prompts), "T=0.7", max_tokens=6, seed0=70)
    llm.reset_prefix_cache()
    first = [vllm_generate(llm, [prompts[0]], [params[0]])[0]] + vllm_generate(llm, prompts[1:], params[1:])
    again = vllm_generate(llm, prompts, params)
    assert first[0][2] == 0 and all(r[2] >= 96 for r in first[1:]), "shared prefix should hit the cache"
    assert all(r[2] >= 96 for r in again)
    assert_matches_trainer(policy, prompts, params, first)
    assert [r[:2] for r in again] == [r[:2] for r in first]
    # a request resumed from its own output: prompt + generated tokens hits the cache past the prompt
    tokens, logprobs, _ = first[0]
    cont = vllm_generate(llm, [prompts[0] + tokens[:3]], [SamplingParams(max_tokens=3, seed=70, temperature=0.7)])[0]
    assert cont[:2] == (tokens[3:], logprobs[3:])


def update_weights(llm, model):
    """The fast path's in-place reload (worker extension), then drop KV computed with the old weights."""
    llm.collective_rpc("zerokl_stage_weights", args=(list(model.state_dict().items()),))
    llm.collective_rpc("zerokl_commit_weights")
    assert llm.reset_prefix_cache()


def test_weight_update_in_place(llm, policy):
    prompts = _prompts(4, seed=12, hi=60)
    params = _params(len(prompts), "T=0.7", max_tokens=6, seed0=110)
    before = vllm_generate(llm, prompts, params)
    new = tiny_model("qwen2", seed=8, **MODEL_KW)
    update_weights(llm, new)
    try:
        after = vllm_generate(llm, prompts, params)
        assert_matches_trainer(new, prompts, params, after)
        assert [r[:2] for r in after] != [r[:2] for r in before]
    finally:
        update_weights(llm, policy)
    assert [r[:2] for r in vllm_generate(llm, prompts, params)] == [r[:2] for r in before]


def _dummy_runs(worker):
    runner = worker.model_runner  # vLLM's profiling / warm-up runs: without and with attention metadata
    return [bool(torch.isfinite(runner._dummy_run(24, force_attention=force)[0]).all()) for force in (False, True)]


def test_dummy_runs_do_not_crash(llm):
    assert llm.collective_rpc(_dummy_runs) == [[True, True]]


def test_plain_vllm_sampling_params_get_the_canonical_rule(llm, policy):
    """A plain vllm.SamplingParams (vLLM's own temperature, top_p, seed and n) samples with our rule:
    sample i of a request with seed S is the request with zerokl seed S + i, every log-prob is the
    trainer's, the n samples differ, and a repeat is identical."""
    from vllm import SamplingParams as VSamplingParams
    prompts = _prompts(3, seed=21)
    plain = VSamplingParams(n=4, temperature=0.8, top_p=0.95, seed=77, max_tokens=8, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    assert plain.temperature == 0.8 and plain.seed == 77  # the caller's params are left as they were
    for prompt, out, rep in zip(prompts, outs, again):
        samples = [completion_tokens(c) for c in sorted(out.outputs, key=lambda c: c.index)]
        assert samples == [completion_tokens(c) for c in sorted(rep.outputs, key=lambda c: c.index)]
        assert len({tuple(tokens) for tokens, _ in samples}) > 1
        ours = [SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=77 + i) for i in range(4)]
        assert [tuple(s) for s in samples] == [tuple(r[:2]) for r in vllm_generate(llm, [prompt] * 4, ours)]
        for tokens, logprobs in samples:
            assert logprobs == trainer_logprobs(policy, prompt, tokens, 0.8)


def test_plain_requests_without_a_seed_get_fresh_ones_and_bad_fields_are_named(llm, policy):
    """A seedless request gets a fresh seed, given back by seed_of(request id): a request with that seed
    replays it sample for sample (sample i: seed + i). Fields that would change the token get a 400."""
    from vllm import SamplingParams as VSamplingParams

    from rollout_service.vllm.plugin import seed_of
    prompt = _prompts(1, seed=22)[0]
    seedless = VSamplingParams(n=2, temperature=1.0, max_tokens=12, logprobs=0, ignore_eos=True)
    runs = [llm.generate([{"prompt_token_ids": prompt}], seedless, use_tqdm=False)[0] for _ in range(2)]
    a, b = ([completion_tokens(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in runs)
    assert a[0][0] != b[0][0]  # fresh seeds: 96**12 continuations, a repeat by chance is out of reach
    assert seedless.seed is None  # the caller's params are left as they were
    for tokens, logprobs in a + b:
        assert logprobs == trainer_logprobs(policy, prompt, tokens, 1.0)
    seeds = [seed_of(out.request_id) for out in runs]
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]
    for seed, samples in zip(seeds, (a, b)):
        replay = VSamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=12, logprobs=0, ignore_eos=True)
        [out] = llm.generate([{"prompt_token_ids": prompt}], replay, use_tqdm=False)
        assert [completion_tokens(c) for c in sorted(out.outputs, key=lambda c: c.index)] == samples
        assert seed_of(out.request_id) == seed
    from vllm.exceptions import VLLMValidationError
    for field, value in (("min_p", 0.1), ("presence_penalty", 0.5), ("repetition_penalty", 1.2)):
        with pytest.raises(VLLMValidationError, match=field):
            llm.generate([{"prompt_token_ids": prompt}], VSamplingParams(temperature=1.0, seed=1, max_tokens=4,
                                                                         **{field: value}), use_tqdm=False)


def test_batch_of_256_mixed_requests(checkpoint, policy, llm):
    """256 requests in one engine of 256 slots (greedy, T = 0.7, T = 1 with top-k/top-p, one in three
    each; prefill chunked under the token budget): every log-prob is the trainer's, and the tokens
    equal those of the 8-slot engine, which runs the same requests in batches of at most 8."""
    prompts = _prompts(256, seed=21, lo=1, hi=24)
    params = [SamplingParams(max_tokens=4, seed=3000 + i, **SAMPLINGS[name])
              for i, name in zip(range(256), list(SAMPLINGS) * 86)]
    narrow = vllm_generate(llm, prompts, params)  # first: closing an in-process engine ends `llm`'s state
    wide = make_llm(checkpoint, max_num_seqs=256, max_num_batched_tokens=512)
    try:
        results = vllm_generate(wide, prompts, params)
    finally:
        close(wide)
    assert_matches_trainer(policy, prompts, params, results)
    assert [r[:2] for r in narrow] == [r[:2] for r in results]


def test_preemption(checkpoint, policy):
    """A KV pool of 24 blocks of 16 tokens (512 bytes a token: 2 layers, K and V, 2 heads of 32, bf16)
    for 8 requests of up to 84 tokens: vLLM preempts and recomputes."""
    prompts = _prompts(8, seed=13, lo=30, hi=60)
    params = _params(len(prompts), "T=0.7", max_tokens=24, seed0=130)
    llm = make_llm(checkpoint, kv_cache_memory_bytes=24 * 16 * 512, max_model_len=128, disable_log_stats=False)
    try:
        results = vllm_generate(llm, prompts, params)
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        close(llm)
    assert preemptions > 0
    assert_matches_trainer(policy, prompts, params, results)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2-tied"])
def test_other_architectures(tmp_path_factory, arch):
    from transformers import AutoModelForCausalLM
    path = _checkpoint(tmp_path_factory, arch, seed=11)
    prompts = _prompts(4, seed=8) + _prompts(1, seed=9, lo=60, hi=70)
    params = _params(3, "T=0.7", 6) + _params(2, "greedy", 6)
    llm = make_llm(path)
    try:
        results = vllm_generate(llm, prompts, params)
    finally:
        close(llm)
    assert_matches_trainer(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), prompts, params, results)
    assert [r.token_ids for r in Engine(path, window=4, group=4).generate(prompts, params)] == [r[0] for r in results]


def test_stock_model_class_differs(checkpoint, policy):
    """Negative control: vLLM's own Qwen2 class with the same processor is not bitwise the trainer."""
    prompts = _prompts(6, seed=10, lo=10, hi=60)
    params = _params(len(prompts), "T=0.7", max_tokens=8, seed0=90)
    llm = make_llm(checkpoint, plugin=False)
    try:
        results = vllm_generate(llm, prompts, params)
    finally:
        close(llm)
    assert count_trainer_mismatches(policy, prompts, params, results) > 0, \
        "the stock class matched the trainer bit for bit: this test cannot fail"


def test_qwen3_moe(tmp_path_factory):
    """Qwen3-MoE: the checkpoint's per-expert tensors load into the fused expert parameters, every
    log-prob equals the trainer's and the tokens the native engine's; a trainer-format (fused) state
    dict reloads in place."""
    from transformers import AutoModelForCausalLM
    path = _checkpoint(tmp_path_factory, "qwen3_moe", seed=12)
    prompts = _prompts(5, seed=14) + _prompts(1, seed=15, lo=60, hi=70)  # one prefilled in chunks
    params = _params(4, "T=1,top_k=5,top_p=0.9", 6) + _params(2, "greedy", 6)
    llm = make_llm(path)
    try:
        results = vllm_generate(llm, prompts, params)
        new = tiny_model("qwen3_moe", seed=13, **MODEL_KW)
        update_weights(llm, new)
        after = vllm_generate(llm, prompts, params)
    finally:
        close(llm)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert_matches_trainer(policy, prompts, params, results)
    assert [r.token_ids for r in Engine(path, window=4, group=4).generate(prompts, params)] == [r[0] for r in results]
    assert_matches_trainer(new, prompts, params, after)
    assert [r[:2] for r in after] != [r[:2] for r in results]
