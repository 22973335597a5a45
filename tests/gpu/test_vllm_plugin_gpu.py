"""On CUDA with real vLLM (the 0.25 bundle on the GPU machine): vLLM's engine running the canonical
forward (rollout_service.vllm.plugin) gives every token the log-prob the trainer computes, bit for bit,
on vLLM's V2 model runner (our sampler from the model state) and its V1 runner (our logits processor),
with decode steps replayed from CUDA graphs and without them, for batches of 1 to 256 mixed requests,
chunked prefill, prefix-cache hits, preemption, in-place weight updates, and Llama / Qwen2 / Qwen3.
vLLM's stock class with the same sampling rule does not match (the negative control).
"""
import gc
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

import transformers  # noqa: E402

from rollout_service import SamplingParams  # noqa: E402
from rollout_service.vllm.instance import WORKER_EXTENSION  # noqa: E402
from rollout_service.vllm.plugin.sampling import PROCESSOR_FQCN  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.vllm.plugin import llm_options, register  # noqa: E402
from vllm_shared import assert_matches_trainer, count_trainer_mismatches, random_prompts, vllm_generate  # noqa: E402,E501

VOCAB = 2048
MAX_BATCHED = 256  # prompts longer than this are prefilled in chunks
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
OPTIONS = dict(dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=True, max_model_len=1024,
               max_num_batched_tokens=MAX_BATCHED, max_num_seqs=256, gpu_memory_utilization=0.25, seed=0,
               worker_extension_cls=WORKER_EXTENSION)
# one request in three each: greedy, T = 0.7, T = 1 with top-k and top-p
MIXED = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, top_k=20, top_p=0.9)]


# down's 8 segments of 200 end mid-tile, as Qwen2.5-1.5B's of 1,120 do (the Gluon kernels' segment view)
SHAPE = dict(hidden_size=512, intermediate_size=1600, num_heads=8, num_kv_heads=2, num_layers=4, vocab_size=VOCAB,
             max_positions=1024)


def _checkpoint(tmp_path_factory, arch, seed=5):
    path = str(tmp_path_factory.mktemp(f"zerokl-gpu-{arch}"))
    tiny_model(arch, seed=seed, dtype=torch.float32, **SHAPE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "qwen2")


@pytest.fixture(scope="module")
def trainer(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda()


def _llm(path, *, plugin=True, cuda_graphs=True, runner=None, **extra):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: register() reaches it
    gc.collect()  # a collected in-process engine tears down vLLM's parallel state: before ours starts
    register()
    from vllm import LLM
    if plugin:
        options = llm_options(path, cuda_graphs=cuda_graphs, runner=runner)
        if cuda_graphs:
            options["compilation_config"]["cudagraph_capture_sizes"] = CAPTURE_SIZES
    else:  # stock class, eager (no torch.compile wait), same sampling processor
        options = dict(logits_processors=[PROCESSOR_FQCN], logprobs_mode="processed_logits", enforce_eager=True)
    return LLM(model=path, **{**OPTIONS, **options, **extra})


def _run(path, work, **llm_kwargs):
    """work(llm) on a fresh engine, which is gone (memory included) when this returns: the next
    engine's memory profiling must not see this one's memory come back."""
    llm = _llm(path, **llm_kwargs)
    try:
        return work(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()  # in-process: frees weights, KV cache and graphs now
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _cudagraph_mode(llm) -> str:
    return llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name


def _runner(llm) -> str:
    return "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"


def _params(n, max_tokens, seed0=100, samplings=MIXED):
    return [SamplingParams(max_tokens=max_tokens, seed=seed0 + i, **samplings[i % len(samplings)]) for i in range(n)]


def test_bitwise_trainer_across_batches_graphs_and_prefix_hits(checkpoint, trainer, monkeypatch):
    # over 256 tokens: chunked prefill; over 512 (kernels.contract.TRITON.attention_split_kv): decode
    # steps reduce the context's splits in parallel where the trainer walks them. V2 with graphs replays
    # every step (no step exceeds the largest capture size): prefill chunks in the [N, 1] layout; the
    # others attend them packed.
    from rollout_service.vllm.plugin import attention
    prompts = random_prompts(256, VOCAB, seed=1, lo=5, hi=700)
    params = _params(len(prompts), 24)
    runs = {}
    packed_steps = []
    build_packed = attention.PrefillGroups.from_query_starts
    monkeypatch.setattr(attention.PrefillGroups, "from_query_starts",
                        lambda *a: packed_steps.append(1) or build_packed(*a))

    def work(llm):
        return (_cudagraph_mode(llm), _runner(llm),
                vllm_generate(llm, prompts, params),  # 256 at once: decode graphs of every captured size
                [vllm_generate(llm, [p], [q])[0] for p, q in zip(prompts[:3], params[:3])],
                vllm_generate(llm, prompts[3:10], params[3:10]),
                vllm_generate(llm, prompts[:16], params[:16]))  # the prompts' KV is cached now

    for runner, cuda_graphs in (("v2", True), ("v2", False), ("v1", True)):
        packed_steps.clear()
        mode, used, batch, alone, subset, again = _run(checkpoint, work, cuda_graphs=cuda_graphs, runner=runner)
        assert mode == ({"v2": "FULL", "v1": "FULL_DECODE_ONLY"}[runner] if cuda_graphs else "NONE")
        assert used == runner
        assert (not packed_steps) == ((runner, cuda_graphs) == ("v2", True)), (runner, cuda_graphs, len(packed_steps))
        assert sum(r[2] for r in again) > 0, "no prefix-cache hit: the cached case was not exercised"
        assert_matches_trainer(trainer, prompts, params, batch)
        strip = lambda rs: [r[:2] for r in rs]  # noqa: E731  (cache hits differ between runs)
        assert strip(alone) == strip(batch[:3])
        assert strip(subset) == strip(batch[3:10])
        assert strip(again) == strip(batch[:16])
        runs[runner, cuda_graphs] = strip(batch)
    assert runs["v2", True] == runs["v2", False] == runs["v1", True]


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_preemption_with_cuda_graphs(checkpoint, trainer, runner):
    """200 blocks of 16 tokens for 48 requests of up to ~180 tokens: vLLM preempts and recomputes
    (a resumed request keeps its prompt length: the V2 sampler's positions stay right)."""
    prompts = random_prompts(48, VOCAB, seed=3, lo=60, hi=120)
    params = _params(len(prompts), 64, seed0=300)

    def work(llm):
        results = vllm_generate(llm, prompts, params)
        return results, sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")

    results, preemptions = _run(checkpoint, work, num_gpu_blocks_override=200, block_size=16,
                                disable_log_stats=False, runner=runner)
    assert preemptions > 0
    assert_matches_trainer(trainer, prompts, params, results)


def test_v2_sampler_output_ours_or_vllms(checkpoint, trainer, monkeypatch):
    """On the V2 runner our sampler builds vLLM's output itself when every row is ours and wants only
    the sampled token's log-prob; rows asking for top-k log-probs go through vLLM's sampler. Every one
    of our rows equals the trainer either way, and plain vLLM greedy rows (which canonical_request
    turns into ours) get the canonical argmax."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from rollout_service.vllm.requests import canonical_vllm_params, completion_tokens
    from rollout_service.vllm.plugin import runner_v2

    built = []
    original = runner_v2.own_sampler_output

    def counting(*args):
        out = original(*args)
        built.append(out is not None)
        return out
    monkeypatch.setattr(runner_v2, "own_sampler_output", counting)

    prompts = random_prompts(16, VOCAB, seed=21, lo=5, hi=300)
    params = _params(len(prompts), 12, seed0=700)
    greedy = [SamplingParams(max_tokens=12, temperature=0.0) for _ in prompts]

    def generate(llm, vparams):
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], vparams, use_tqdm=False)
        return [completion_tokens(o.outputs[0]) for o in outs]

    def work(llm):
        assert _runner(llm) == "v2"
        ours = vllm_generate(llm, prompts, params)
        ours_greedy = vllm_generate(llm, prompts, greedy)
        built_before_mixed = list(built)
        plain = VSamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        top2 = [canonical_vllm_params(p, len(q), p.max_tokens) for p, q in zip(params, prompts)]
        for v in top2:
            v.logprobs = 2
        mixed = generate(llm, [plain if i % 2 else canonical_vllm_params(params[i], len(q), 12)
                               for i, q in enumerate(prompts)])
        with_top2 = generate(llm, top2)
        return ours, ours_greedy, built_before_mixed, mixed, with_top2

    ours, ours_greedy, built_before_mixed, mixed, with_top2 = _run(checkpoint, work, runner="v2")
    assert built_before_mixed and all(built_before_mixed), "our own output was not built for all-ours batches"
    assert not all(built), "mixed and top-k batches never went through vLLM's sampler"
    assert_matches_trainer(trainer, prompts, params, ours)
    assert_matches_trainer(trainer, prompts, greedy, ours_greedy)
    assert mixed[::2] == [r[:2] for r in ours[::2]]
    assert [m[0] for m in mixed[1::2]] == [r[0] for r in ours_greedy[1::2]]
    assert [m[0] for m in with_top2] == [r[0] for r in ours]
    assert [m[1] for m in with_top2] == [r[1] for r in ours]


def test_rollout_sampling_replayed_from_graphs(checkpoint, trainer, monkeypatch):
    """Rollout batches (no top-k / top-p) sample from our CUDA graphs on V2 with CUDA graphs, padded
    to power-of-two buckets; the bits equal the trainer's and those of the eager sampler (enforce_eager,
    where the graphs are not used)."""
    from rollout_service.vllm.sampler_graphs import SamplerGraphs

    calls = []
    original = SamplerGraphs.__call__

    def counting(self, logits, rows):
        calls.append(len(rows))
        return original(self, logits, rows)
    monkeypatch.setattr(SamplerGraphs, "__call__", counting)

    prompts = random_prompts(256, VOCAB, seed=31, lo=5, hi=600)
    params = _params(len(prompts), 20, seed0=900, samplings=[dict(temperature=0.0), dict(temperature=0.7),
                                                              dict(temperature=1.0)])
    sizes = (1, 5, 40, 256)

    def work(llm):
        assert _runner(llm) == "v2"
        return [vllm_generate(llm, prompts[:k], params[:k]) for k in sizes]

    graphed = _run(checkpoint, work)
    graphed_calls = list(calls)
    eager = _run(checkpoint, work, cuda_graphs=False)
    assert graphed_calls and len(calls) == len(graphed_calls), "graphs unused with CUDA graphs, or used without"
    assert any(n & (n - 1) for n in graphed_calls), "no padded bucket was replayed"
    for k, ours, plain in zip(sizes, graphed, eager):
        assert_matches_trainer(trainer, prompts[:k], params[:k], ours)
        assert [r[:2] for r in ours] == [r[:2] for r in plain]


def test_weight_update_in_place_keeps_graphs_valid(checkpoint, trainer):
    prompts = random_prompts(8, VOCAB, seed=4, lo=5, hi=100)
    params = _params(len(prompts), 16, seed0=400)
    new = tiny_model("qwen2", seed=9, dtype=torch.float32, **SHAPE).to(torch.bfloat16).cuda()

    def work(llm):
        before = vllm_generate(llm, prompts, params)
        llm.collective_rpc("zerokl_stage_weights", args=(list(new.state_dict().items()),))
        llm.collective_rpc("zerokl_commit_weights")
        assert llm.reset_prefix_cache()
        return before, vllm_generate(llm, prompts, params)

    before, after = _run(checkpoint, work)
    assert_matches_trainer(trainer, prompts, params, before)
    assert_matches_trainer(new, prompts, params, after)
    assert [r[:2] for r in after] != [r[:2] for r in before]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])  # MoE: grouped experts, in CUDA graphs too
def test_other_architectures(tmp_path_factory, arch):
    path = _checkpoint(tmp_path_factory, arch, seed=11)
    prompts = random_prompts(32, VOCAB, seed=5, lo=5, hi=300)
    params = _params(len(prompts), 16, seed0=500)
    results = _run(path, lambda llm: vllm_generate(llm, prompts, params))
    policy = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    assert_matches_trainer(policy, prompts, params, results)


def test_stock_model_class_differs(checkpoint, trainer):
    """Negative control: vLLM's own Qwen2 class with the same processor is not bitwise the trainer."""
    prompts = random_prompts(24, VOCAB, seed=1, lo=5, hi=400)
    params = _params(len(prompts), 24)
    results = _run(checkpoint, lambda llm: vllm_generate(llm, prompts, params), plugin=False)
    assert count_trainer_mismatches(trainer, prompts, params, results) > 0, \
        "the stock class matched the trainer bit for bit: this test cannot fail"


def test_worker_engine_serves_verified_and_off_side_by_side(checkpoint, trainer):
    """VLLMEngine, the engine of a GPU RolloutWorker, with stock_for_off: two vLLM engines, the
    canonical one and stock vLLM (its own sampler) for `off`, both with their cores in this process
    (the default placement), on the V2 runner with CUDA graphs. Verified requests equal the trainer
    bit for bit; off ones do not."""
    from rollout_service.vllm.engine import VLLMEngine

    gc.collect()
    engine = VLLMEngine(checkpoint, device="cuda", max_model_len=1024, max_num_seqs=64, stock_for_off=True,
                        gpu_memory_utilization=0.5)
    try:
        prompts = random_prompts(24, VOCAB, seed=13, lo=5, hi=300)
        params = [SamplingParams(max_tokens=24, seed=900 + i, determinism=("verified", "off")[i % 2],
                                 **MIXED[i % 3]) for i in range(len(prompts))]
        outs = engine.generate(prompts, params)
        assert all(o.ok and len(o.token_ids) == 24 for o in outs), [o.error for o in outs if not o.ok]
        assert engine.canonical.runner == "v2" and engine.canonical.in_process and engine.stock.in_process
        results = [(o.token_ids, o.logprobs, 0) for o in outs]
        assert_matches_trainer(trainer, prompts[::2], params[::2], results[::2])
        assert count_trainer_mismatches(trainer, prompts[1::2], params[1::2], results[1::2]) > 0
    finally:
        engine.close()


def test_level_2_sleep_restores_or_takes_a_push(checkpoint, trainer):
    """VLLMEngine with sleep_mode (the colocated placement): level 2 discards the weights. A wake with
    no push serves the host copy again, bit for bit; a complete bucketed push after a wake serves the
    new weights, bit for bit. Control: the engine woken without either, after another allocation has
    used the freed memory (a trainer rank does), does not match. Both wakes the engine has: whole, and
    in two halves, the weights' memory mapped right after the sleep (wake_weights, what the rollout
    worker calls behind each sleep with early_weights_wake) and the KV cache only at the wake; the same
    holds. One engine serves both rounds: vLLM's sleep-mode allocator refuses a second engine in a
    process while blocks of the first are still in its pool (as cases of their own, the second case's
    build failed so), and early_weights_wake only arms wake_weights: the round without it wakes whole."""
    from rollout_service.vllm.engine import VLLMEngine

    gc.collect()
    engine = VLLMEngine(checkpoint, device="cuda", max_model_len=1024, max_num_seqs=64, sleep_mode=True,
                        sleep_level=2, gpu_memory_utilization=0.3, early_weights_wake=True)
    prompts = random_prompts(16, VOCAB, seed=21, lo=5, hi=200)
    params = [SamplingParams(max_tokens=16, seed=1300 + i, **MIXED[i % 3]) for i in range(len(prompts))]

    def rollouts():
        return [(o.token_ids, o.logprobs, 0) for o in engine.generate(prompts, params)]

    def sleep_and_scribble(early: bool):
        engine.sleep()
        free, _ = torch.cuda.mem_get_info()
        if early:
            free_asleep = free
            engine.wake_weights()
            free, _ = torch.cuda.mem_get_info()
            assert 0 < free_asleep - free < 0.5 * free_asleep  # the weights mapped again, the KV cache not
            assert engine.canonical.sleeping
        scribble = torch.full((int(free * 0.8),), 0x3F, dtype=torch.uint8, device="cuda")
        del scribble
        torch.cuda.empty_cache()

    try:
        assert all(t.is_pinned() for t in engine.model.state_dict().values())  # pushes copy into it
        before = rollouts()
        assert_matches_trainer(trainer, prompts, params, before)

        # (woken early, the weights' memory is mapped before the scribble can reach it: no control)
        sleep_and_scribble(early=False)
        engine.canonical.wake()  # what the engine's own wake does, without the restore on the next request
        discarded = vllm_generate(engine.canonical.llm, prompts, params)
        assert [r[:2] for r in discarded] != [r[:2] for r in before], "discarded weights served the old tokens"
        assert rollouts() == before  # the next request loaded the host copy first

        for early, seed in ((False, 9), (True, 10)):
            sleep_and_scribble(early)
            engine.wake()
            assert rollouts() == before, f"early={early}: the host copy"

            new = tiny_model("qwen2", seed=seed, dtype=torch.float32, **SHAPE).to(torch.bfloat16).cuda()
            sleep_and_scribble(early)
            engine.wake()
            engine.load_named_weights(list(new.state_dict().items()))
            engine.finish_weight_load()
            after = rollouts()
            assert_matches_trainer(new, prompts, params, after)
            assert [r[:2] for r in after] != [r[:2] for r in before], f"early={early}: the push"
            before = after
    finally:
        engine.close()
