"""vLLM's own tensor parallelism running the canonical model (rollout_service.vllm.plugin.tensor_parallel),
on vLLM's CPU build: TP = 2, 4 and 8 worker processes (vLLM's multiprocessing executor and its CPU
communicator) give tokens and log-probs bitwise equal to the TP = 1 trainer (`from_pretrained` in bf16)
and to the TP = 1 native engine, through chunked prefill, prefix-cache hits, batch compositions and an
in-place weight update. The negative control runs the same shards with each rank's row-parallel output
rounded to bf16 and summed by vLLM's all-reduce, as stock vLLM models do: it differs.
"""
import gc
import os
import random

import pytest
import torch

pytest.importorskip("vllm")

from rollout_service import Engine, SamplingParams  # noqa: E402
from rollout_service.vllm.instance import WORKER_EXTENSION  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.vllm.plugin import llm_options, register  # noqa: E402
from rollout_service.vllm.plugin.tensor_parallel import TP_REDUCE_KEY  # noqa: E402
from vllm_shared import assert_matches_trainer, count_trainer_mismatches, random_prompts, vllm_generate  # noqa: E402,E501

# 8 heads, 4 KV heads: TP up to 4 (the TP = 8 checkpoint has 8 KV heads). A vocabulary of 97 pads
# each rank's lm_head shard with zero rows.
MODEL_KW = dict(hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=512, vocab_size=97)
VOCAB = 97
MAX_BATCHED = 48  # prompts longer than this are prefilled in chunks
ENGINE = dict(dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=True, block_size=16,
              kv_cache_memory_bytes=64 << 20, max_model_len=256, max_num_batched_tokens=MAX_BATCHED, max_num_seqs=8,
              seed=0, worker_extension_cls=WORKER_EXTENSION)
SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, top_k=5, top_p=0.9)]


def _params(n, max_tokens, seed0):
    return [SamplingParams(max_tokens=max_tokens, seed=seed0 + i, **SAMPLINGS[i % len(SAMPLINGS)]) for i in range(n)]


def make_llm(path, k, **options):
    """vLLM's LLM over k worker processes, as a user builds it: llm_options(checkpoint, tensor_parallel_size=k)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core here, ranks in worker processes
    gc.collect()
    register()
    from vllm import LLM
    return LLM(model=path, **ENGINE, **llm_options(path, cuda_graphs=False, tensor_parallel_size=k), **options)


def _checkpoint(tmp_path_factory, name, seed, tied=False, **kw):
    path = str(tmp_path_factory.mktemp(name))
    model = tiny_model("qwen2", seed=seed, **{**MODEL_KW, **kw})
    if tied:  # saved without lm_head.weight: each rank cuts its lm_head shard from the embedding
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "zerokl-tp", seed=21)


@pytest.fixture(scope="module")
def policy(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tp2(checkpoint):
    llm = make_llm(checkpoint, 2)
    yield llm
    del llm
    gc.collect()


def _workload():
    prompts = random_prompts(6, VOCAB, seed=1) + random_prompts(2, VOCAB, seed=2, lo=60, hi=90)  # last two chunked
    return prompts, _params(len(prompts), max_tokens=8, seed0=300)


def test_tp2_equals_tp1_trainer_and_native_engine(tp2, policy, checkpoint):
    prompts, params = _workload()
    results = vllm_generate(tp2, prompts, params)
    assert_matches_trainer(policy, prompts, params, results)
    native = Engine(checkpoint, window=4, group=4).generate(prompts, params)
    assert [r.token_ids for r in native] == [tokens for tokens, _, _ in results]
    assert [r.logprobs for r in native] == [logprobs for _, logprobs, _ in results]


def test_tp2_batch_compositions_and_prefix_hits(tp2, policy):
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(70)]  # > MAX_BATCHED: prefilled in chunks, then cached
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    prompts += random_prompts(3, VOCAB, seed=6)
    params = _params(len(prompts), max_tokens=6, seed0=400)
    tp2.reset_prefix_cache()
    alone = [vllm_generate(tp2, [p], [s])[0] for p, s in zip(prompts, params)]
    together = vllm_generate(tp2, prompts[::-1], params[::-1])[::-1]
    assert all(r[2] >= 64 for r in together[:3]), "the shared prefix should hit the cache"
    assert [r[:2] for r in alone] == [r[:2] for r in together]
    assert_matches_trainer(policy, prompts, params, alone)


def _generate_once(path, k, prompts, params, **options):
    """The workload on a fresh k-rank engine, shut down before this returns."""
    llm = make_llm(path, k, **options)
    try:
        return vllm_generate(llm, prompts, params)
    finally:
        del llm
        gc.collect()


@pytest.mark.slow  # 20-30 s on a 2-core machine: the fast suite stays under 20 minutes
def test_bf16_all_reduce_control_differs(checkpoint, policy):
    prompts, params = _workload()
    results = _generate_once(checkpoint, 2, prompts, params, additional_config={TP_REDUCE_KEY: "bf16_all_reduce"})
    assert count_trainer_mismatches(policy, prompts, params, results) > 0


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_tree_scatter_reduce_at_tp4_on_a_tied_checkpoint_equals_trainer(tmp_path_factory):
    """At TP = 4, where the tree's association matters, a checkpoint with tied embeddings (its lm head
    sharded from the embedding) under the tree split by output columns (an all-to-all over vLLM's TP
    group, then an all-gather of the rounded columns) gives the trainer's bits. (The default tree
    reduce at full width: test_tp8_equals_trainer.)"""
    from transformers import AutoModelForCausalLM
    path = _checkpoint(tmp_path_factory, "zerokl-tp4-tied", seed=22, tied=True)
    prompts, params = _workload()
    results = _generate_once(path, 4, prompts, params, additional_config={TP_REDUCE_KEY: "tree_scatter"})
    assert_matches_trainer(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), prompts, params, results)


@pytest.mark.slow
def test_tp8_equals_trainer(tmp_path_factory):
    """TP = 8, the tree's full width: each rank holds one segment of every row-parallel product, so the
    combine is the whole tree. Equal to the trainer. The bf16 all-reduce control differs: through vLLM at TP = 2
    (test_bf16_all_reduce_control_differs) and, for a layer, at TP = 8 (tests/test_tp.py)."""
    from transformers import AutoModelForCausalLM
    path = _checkpoint(tmp_path_factory, "zerokl-tp8", seed=25, num_kv_heads=8)  # vocab 97: 8 shards of 13
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    prompts, params = _workload()
    assert_matches_trainer(trainer, prompts, params, _generate_once(path, 8, prompts, params))


@pytest.mark.slow  # 20-30 s on a 2-core machine: the fast suite stays under 20 minutes
def test_worker_engine_at_tp2_with_a_weight_push(checkpoint, policy):
    """VLLMEngine, a RolloutWorker's engine on vLLM, at tensor_parallel_size=2: its rollouts equal
    the trainer's; a weight push (files to each worker process, vLLM's in-place reload, each rank
    loading its slice of the full weights) returns the pushed weights' digest and the new rollouts
    equal the new trainer's."""
    from rollout_service.vllm.engine import VLLMEngine
    from rollout_service.weights import model_digest
    prompts, params = _workload()
    engine = VLLMEngine(checkpoint, device="cpu", tensor_parallel_size=2, max_model_len=256, max_num_seqs=8,
                        vllm_options=dict(block_size=16, max_num_batched_tokens=MAX_BATCHED))
    try:
        assert not engine.canonical.in_process  # the ranks are vLLM's worker processes
        before = [(r.token_ids, r.logprobs, 0) for r in engine.generate(prompts, params)]
        assert_matches_trainer(policy, prompts, params, before)
        new = tiny_model("qwen2", seed=23, **MODEL_KW)
        assert engine.update_weights(new.state_dict()) == model_digest(new.to(torch.bfloat16))
        after = [(r.token_ids, r.logprobs, 0) for r in engine.generate(prompts, params)]
    finally:
        engine.close()
    assert_matches_trainer(new, prompts, params, after)
    assert [r[:2] for r in after] != [r[:2] for r in before]


def test_a_model_that_cannot_be_split_is_refused_before_workers_start(tmp_path_factory):
    path = _checkpoint(tmp_path_factory, "zerokl-tp-kv2", seed=24, num_kv_heads=2)
    with pytest.raises(ValueError, match="divisible by 4"):
        llm_options(path, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor-parallel degree"):
        llm_options(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        llm_options(path, tensor_parallel_size=0)


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_pool_worker_runs_vllm_tp_from_a_checkpoint_path(checkpoint):
    """A checkpoint path handed to a pool worker with backend="vllm" and tensor_parallel_size=2: the
    worker's actor runs vLLM's TP (two worker processes of its own) and its rollouts are the TP = 1
    native engine's, bit for bit."""
    import service_shared as shared
    from rollout_service import start_pool
    shared.cluster()
    prompts, params = _workload()
    pool = start_pool(checkpoint, num_workers=1, name="vllm-tp2", engine_kwargs=dict(
        backend="vllm", device="cpu", tensor_parallel_size=2, max_model_len=256, max_num_seqs=8,
        vllm_options=dict(block_size=16, max_num_batched_tokens=MAX_BATCHED)))
    try:
        got = pool.generate(prompts, params)
    finally:
        pool.shutdown()
    shared.assert_same(got, Engine(checkpoint, window=4, group=4).generate(prompts, params), "vllm TP=2 worker")


def test_reduce_setting_is_checked_before_the_model_is_built():
    """additional_config's reduce (PluginTP.from_vllm reads vLLM's config when vLLM builds the model):
    "tree" without GPUs by default; an unknown name, and the peer-to-peer tree without CUDA, are
    refused with the reason."""
    from types import SimpleNamespace
    from rollout_service.vllm.plugin.tensor_parallel import PluginTP

    def config(reduce=None, k=2):
        return SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=k),
                               additional_config={TP_REDUCE_KEY: reduce} if reduce else {})
    assert PluginTP.from_vllm(config(k=1)).reduce == "tree"  # the default without GPUs
    assert PluginTP.from_vllm(config("tree_scatter", k=1)).reduce == "tree_scatter"
    with pytest.raises(ValueError, match="must be one of"):
        PluginTP.from_vllm(config("ring"))
    with pytest.raises(ValueError, match="needs CUDA"):
        PluginTP.from_vllm(config("tree_p2p"))
