"""On CUDA with real vLLM (the 0.25 bundle on the GPU machine): vLLM's engine running the canonical
forward (rollout_service.vllm_plugin) gives every token the log-prob the trainer computes, bit for bit,
alone or in a batch, with chunked prefill; vLLM's stock class with the same sampling rule does not.
"""
import gc
import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

import transformers  # noqa: E402

import trainer_patch  # noqa: E402
from rollout_service.fast_path.vllm import EXTRA_ARGS_KEY, PROCESSOR_FQCN  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.vllm_plugin import HF_OVERRIDES, register  # noqa: E402

VOCAB = 2048
OPTIONS = dict(dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=True, enforce_eager=True,
               logits_processors=[PROCESSOR_FQCN], logprobs_mode="processed_logits", max_model_len=1024,
               max_num_batched_tokens=256, gpu_memory_utilization=0.25, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zerokl-gpu-plugin"))
    tiny_model("qwen2", seed=5, dtype=torch.float32, hidden_size=512, intermediate_size=1536, num_heads=8,
               num_kv_heads=2, num_layers=4, vocab_size=VOCAB, max_positions=1024).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trainer(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda()


def _llm(path, plugin):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: register() reaches it
    register()
    from vllm import LLM
    return LLM(model=path, **OPTIONS, **(dict(hf_overrides=HF_OVERRIDES) if plugin else {}))


def _generate(llm, prompts, temperature, max_tokens, seed0=100):
    from vllm import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False,
                             extra_args={EXTRA_ARGS_KEY: dict(seed=seed0 + i, temperature=temperature, top_k=-1,
                                                              top_p=1.0, position=len(p))})
              for i, p in enumerate(prompts)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [o.outputs[0].logprobs[j][t].logprob for j, t in enumerate(o.outputs[0].token_ids)]) for o in outs]


def _trainer_logprobs(trainer, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        return trainer_patch.token_logprobs(trainer, ids, temperature=temperature)[0, -len(tokens):].tolist()


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 400))] for _ in range(n)]


def test_plugin_equals_trainer_and_is_batch_invariant_stock_differs(checkpoint, trainer):
    prompts = _prompts(24, seed=1)  # prompts over 256 tokens are prefilled in chunks
    llm = _llm(checkpoint, plugin=True)
    try:
        batch = _generate(llm, prompts, 0.7, 32)
        alone = [_generate(llm, [p], 0.7, 32, seed0=100 + i)[0] for i, p in enumerate(prompts[:4])]
        greedy = _generate(llm, prompts[:6], 0.0, 16)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for prompt, (tokens, logprobs) in zip(prompts, batch):
        assert logprobs == _trainer_logprobs(trainer, prompt, tokens, 0.7)
    assert alone == batch[:4]
    for prompt, (tokens, logprobs) in zip(prompts, greedy):
        assert logprobs == _trainer_logprobs(trainer, prompt, tokens, 0.0)

    stock = _llm(checkpoint, plugin=False)  # negative control: vLLM's own Qwen2 class, same sampling rule
    try:
        stock_out = _generate(stock, prompts, 0.7, 32)
    finally:
        del stock
        gc.collect()
        torch.cuda.empty_cache()
    diffs = sum(a != b for prompt, (tokens, lps) in zip(prompts, stock_out)
                for a, b in zip(lps, _trainer_logprobs(trainer, prompt, tokens, 0.7)))
    assert diffs > 0, "the stock class matched the trainer bit for bit: this test cannot fail"
