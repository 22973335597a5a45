"""`vllm serve` with the plugin on CUDA (the 0.25 bundle): /v1/completions answers concurrent requests
(greedy, T = 0.7, T = 1 with top-k and top-p; prompts prefilled in chunks and decoded across an
attention split) with the canonical tokens and log-probs, bitwise equal to trainer_patch.token_logprobs
on the checkpoint loaded with `from_pretrained` in bf16; decode steps replay CUDA graphs. The control:
the same checkpoint's stock forward (unpatched transformers, cuBLAS and SDPA) gives other log-probs for
the same tokens.

vLLM's engine core runs in its own process and finds the plugin through its entry point: the package
must be installed (`pip install -e . --no-deps`). On a machine without network, the server's own packages come
as wheels: scripts/vllm_server_gpu_wheels.sh.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

import transformers  # noqa: E402

from rollout_service import SamplingParams  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from serve_shared import call, complete_all, running_server, save_word_tokenizer  # noqa: E402
from vllm_shared import random_prompts, trainer_logprobs  # noqa: E402

VOCAB = 2048
MIXED = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, top_k=20, top_p=0.9)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from importlib.metadata import entry_points
    plugins = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "rollout_service.vllm.plugin:register" in plugins, \
        "vLLM's engine-core process loads the plugin by its entry point: pip install -e . --no-deps"
    path = str(tmp_path_factory.mktemp("zerokl-serve-gpu"))
    tiny_model("qwen2", seed=11, dtype=torch.float32, hidden_size=512, intermediate_size=1536, num_heads=8,
               num_kv_heads=2, num_layers=4, vocab_size=VOCAB, max_positions=1024).save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("zerokl-serve-gpu-log") / "server.log"
    try:
        with running_server(checkpoint, log_path, "--gpu-memory-utilization", "0.3", "--max-model-len", "1024",
                            "--max-num-seqs", "64", "--max-num-batched-tokens", "256") as base:
            yield base
    except RuntimeError as err:
        pytest.fail(str(err))


def test_served_rollouts_equal_the_trainer(server, checkpoint):
    # 48 concurrent requests; prompts up to 700 tokens: chunked prefill, decode past the 512-key split
    prompts = random_prompts(44, VOCAB, seed=3, lo=5, hi=300) + random_prompts(4, VOCAB, seed=4, lo=600, hi=700)
    params = [SamplingParams(max_tokens=24, seed=500 + i, **MIXED[i % 3]) for i in range(len(prompts))]
    results = complete_all(server, prompts, params)
    assert call(server + "/health", timeout=10)[0] == 200

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda()
    trainer, stock = load(), load()  # token_logprobs patches the trainer's model; `stock` stays unpatched
    stock_mismatches = 0
    for prompt, p, (tokens, logprobs) in zip(prompts, params, results):
        assert len(tokens) == p.max_tokens
        assert logprobs == trainer_logprobs(trainer, prompt, tokens, p.temperature), (len(prompt), tokens)
        stock_mismatches += sum(a != b for a, b in zip(logprobs, _stock_logprobs(stock, prompt, tokens, p)))
    assert stock_mismatches > 0, "the stock forward matched the canonical log-probs: the comparison is blind"


def _stock_logprobs(model, prompt, tokens, p):
    """The unpatched model's log-probs of `tokens` at the request's temperature (greedy: T = 1)."""
    ids = torch.tensor([list(prompt) + list(tokens)], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / (p.temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0].tolist()
