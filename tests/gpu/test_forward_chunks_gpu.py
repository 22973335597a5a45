"""On CUDA: a long step's MLP in row chunks gives the whole step's bits.

The chunks and the whole step pick different matmul launch configurations (the tables go by M); each
output row reduces in the same fixed order either way.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import transformers  # noqa: E402

import kernels.forward as forward_module  # noqa: E402
from kernels.forward import forward_hidden, fuse_projections  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402


@pytest.mark.parametrize("fused", [False, True])
def test_mlp_row_chunks_bitwise_equal_whole_step(tmp_path, monkeypatch, fused):
    tiny_model("llama", seed=3, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=768,
               max_positions=2048).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    if fused:
        fuse_projections(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 1100), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    positions = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    with torch.no_grad():
        whole = forward_hidden(model, ids, positions)
        for rows in (512, 200, 64):  # 1,100 rows: chunks of 512 / 200 / 64 and a shorter last one
            monkeypatch.setattr(forward_module, "MLP_CHUNK_ROWS", rows)
            chunked = forward_hidden(model, ids, positions)
            assert torch.equal(chunked, whole), rows
