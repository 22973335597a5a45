"""On CUDA: a trainer's from_pretrained(bf16) model scores the engine's rollouts bit for bit.

from_pretrained(dtype=bf16) keeps the rotary inv_freq buffer in float32, the engine's load casts it to
bf16; the canonical table comes from the config, so both sides agree (CUDA graphs included).
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import transformers  # noqa: E402

import trainer_patch  # noqa: E402
from conftest import assert_bitwise_equal  # noqa: E402
from rollout_service import Engine, SamplingParams  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402

CUDA = torch.device("cuda")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}


@pytest.mark.parametrize("arch,rope", [("llama", LLAMA3), ("qwen2", YARN), ("qwen3", None)])
def test_from_pretrained_bf16_scores_cuda_engine_rollouts_bitwise(tmp_path, arch, rope):
    model = tiny_model(arch, seed=2, dtype=torch.float32, hidden_size=256, intermediate_size=768, num_heads=8,
                       num_kv_heads=2, vocab_size=1024, max_positions=256)
    if rope is not None:
        model.config.rope_parameters = dict(rope)
    model.save_pretrained(tmp_path)  # float32 masters, as a trainer saves them
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (9, 30, 17, 41)]
    rollouts = Engine(str(tmp_path), device="cuda").generate(
        prompts, [SamplingParams(max_tokens=40, temperature=0.7, seed=i) for i in range(len(prompts))])

    trainer = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to(CUDA)
    seqs = [r.prompt_token_ids + r.token_ids for r in rollouts]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        logp = trainer_patch.token_logprobs(trainer, ids.to(CUDA), mask.to(CUDA), temperature=0.7).cpu()
    for i, r in enumerate(rollouts):
        assert r.ok and len(r.token_ids) == 40, r.error
        n = len(r.prompt_token_ids)
        assert_bitwise_equal(logp[i, n - 1:n - 1 + len(r.token_ids)], torch.tensor(r.logprobs, dtype=torch.float32),
                             f"rollout {i}")
