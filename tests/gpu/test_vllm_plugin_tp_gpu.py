"""vLLM's own tensor parallelism on several GPUs (the 0.25 bundle): k worker processes, one GPU each,
run the canonical model's shards and combine row-parallel outputs by the segment tree
(rollout_service.vllm.plugin.tensor_parallel; on GPUs by default one kernel reading the peers' nodes
from symmetric memory, `tree_p2p`). Every token's log-prob equals the TP = 1 trainer's
(`from_pretrained` in bf16, one GPU) bit for bit, with decode steps from CUDA graphs and without, through
chunked prefill, prefix-cache hits and mixed batches, also with the tree split by output columns
(`tree_scatter`: an all-to-all, then an all-gather) and all-gathered over vLLM's TP group (`tree`);
an in-place weight push reaches every rank. The
control, each rank's output rounded to bf16 and summed by vLLM's all-reduce (stock vLLM's way), differs.

vLLM's worker processes find the plugin through its entry point: the package must be installed
(`pip install -e . --no-deps`).
"""
import gc
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA GPUs", allow_module_level=True)
pytest.importorskip("vllm")

import transformers  # noqa: E402

from rollout_service import SamplingParams  # noqa: E402
from rollout_service.vllm.instance import WORKER_EXTENSION  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.vllm.plugin import llm_options, register, require_entry_point  # noqa: E402
from rollout_service.vllm.plugin.tensor_parallel import TP_REDUCE_KEY  # noqa: E402
from vllm_shared import assert_matches_trainer, count_trainer_mismatches, random_prompts, vllm_generate  # noqa: E402,E501

VOCAB = 4099  # not a multiple of k: each rank's lm_head shard is padded with zero rows
MODEL_KW = dict(hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=8, num_layers=4,
                vocab_size=VOCAB, max_positions=1024)  # 8 KV heads: TP up to 8
MAX_BATCHED = 256  # prompts longer than this are prefilled in chunks
OPTIONS = dict(dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=True, max_model_len=1024,
               max_num_batched_tokens=MAX_BATCHED, max_num_seqs=128, gpu_memory_utilization=0.3, seed=0,
               worker_extension_cls=WORKER_EXTENSION)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
MIXED = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, top_k=20, top_p=0.9)]


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda k: f"tp{k}")
def k(request):
    if torch.cuda.device_count() < request.param:
        pytest.skip(f"needs {request.param} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    require_entry_point()  # vLLM's worker processes load the plugin by it: pip install -e . --no-deps
    return request.param


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zerokl-tp-gpu"))
    tiny_model("qwen2", seed=31, dtype=torch.float32, **MODEL_KW).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trainer(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda()


def _run(path, k, work, *, cuda_graphs=True, **extra):
    """work(llm) on a fresh engine over k GPUs, shut down (workers gone) when this returns."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core here, ranks in vLLM's worker processes
    gc.collect()
    register()
    from vllm import LLM
    options = llm_options(path, cuda_graphs=cuda_graphs, tensor_parallel_size=k)
    if cuda_graphs:
        options["compilation_config"]["cudagraph_capture_sizes"] = CAPTURE_SIZES
    llm = LLM(model=path, **{**OPTIONS, **options, **extra})
    try:
        return work(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _params(n, max_tokens, seed0=100):
    return [SamplingParams(max_tokens=max_tokens, seed=seed0 + i, **MIXED[i % 3]) for i in range(n)]


def _workload():
    prompts = random_prompts(96, VOCAB, seed=1, lo=5, hi=400)  # over 256 tokens: chunked prefill
    prompts += [prompts[0][:300] + p for p in random_prompts(8, VOCAB, seed=2, lo=1, hi=30)]  # shared prefix
    return prompts, _params(len(prompts), 24)


def test_tp_equals_tp1_trainer_with_and_without_graphs(checkpoint, trainer, k):
    prompts, params = _workload()

    def work(llm):
        together = vllm_generate(llm, prompts, params)
        alone = [vllm_generate(llm, [p], [q])[0] for p, q in zip(prompts[:2], params[:2])]
        again = vllm_generate(llm, prompts[-8:], params[-8:])  # cached now
        return together, alone, again

    strip = lambda rs: [r[:2] for r in rs]  # noqa: E731  (cache hits differ between runs)
    graphs = _run(checkpoint, k, work)
    together, alone, again = graphs
    assert sum(r[2] for r in again) > 0, "no prefix-cache hit: the cached case was not exercised"
    assert_matches_trainer(trainer, prompts, params, together)
    assert strip(alone) == strip(together[:2]) and strip(again) == strip(together[-8:])
    eager = _run(checkpoint, k, work, cuda_graphs=False)
    assert strip(eager[0]) == strip(together)


def test_default_reduce_on_gpus_is_the_peer_tree():
    from rollout_service.vllm.plugin.tensor_parallel import default_reduce
    assert default_reduce() == "tree_p2p"


@pytest.mark.parametrize("reduce", ["tree", "tree_scatter"])
def test_other_tree_schedules_equal_tp1_trainer_with_graphs(checkpoint, trainer, k, reduce):
    """The same adds scheduled otherwise than the default (the peers' nodes read from symmetric memory
    by one kernel), captured in the decode graphs: all-gathered over vLLM's TP group, or split by
    output columns (an all-to-all, then an all-gather of the rounded columns). The trainer's bits."""
    prompts, params = _workload()
    results = _run(checkpoint, k, lambda llm: vllm_generate(llm, prompts, params),
                   additional_config={TP_REDUCE_KEY: reduce})
    assert_matches_trainer(trainer, prompts, params, results)


def test_weight_push_reaches_every_rank(checkpoint, trainer, k):
    """VLLMInstance.update_weights: the full state dict through files to every worker, each loading its slice."""
    from rollout_service.vllm.instance import VLLMInstance
    from rollout_service.vllm.plugin import HF_OVERRIDES
    prompts, params = _workload()
    prompts, params = prompts[:16], params[:16]
    new = tiny_model("qwen2", seed=32, dtype=torch.float32, **MODEL_KW).to(torch.bfloat16)
    gc.collect()
    fast = VLLMInstance(checkpoint, hf_overrides=dict(HF_OVERRIDES), tensor_parallel_size=k, max_model_len=1024,
                        gpu_memory_utilization=0.3, enforce_eager=True)
    try:
        before = vllm_generate(fast.llm, prompts, params)
        fast.update_weights(new.state_dict())
        after = vllm_generate(fast.llm, prompts, params)
    finally:
        fast.close()
    assert_matches_trainer(trainer, prompts, params, before)
    assert_matches_trainer(new.cuda(), prompts, params, after)


def test_bf16_all_reduce_control_differs(checkpoint, trainer, k):
    prompts, params = _workload()
    results = _run(checkpoint, k, lambda llm: vllm_generate(llm, prompts, params),
                   additional_config={TP_REDUCE_KEY: "bf16_all_reduce"})
    assert count_trainer_mismatches(trainer, prompts, params, results) > 0, \
        "a bf16 all-reduce matched the trainer bit for bit: this test cannot fail"
