"""kernels.forward.fuse_projections (the vLLM plugin's model): q/k/v and gate/up as one matmul each
give the unfused forward's bits, and loads into the fused parameters in place keep the fusion."""
import dataclasses

import pytest
import torch
import transformers

from kernels.forward import CANONICAL_OPS, GATE_UP, QKV, compute_logits, forward_hidden, fuse_projections
from rollout_service.tiny_models import tiny_model

KW = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def _logits(model, ids, calls=None):
    positions = torch.arange(ids.shape[1]).expand_as(ids)

    def linear(*args, **kwargs):
        if calls is not None:
            calls.append(args[1].shape[0])  # rows of the weight each matmul streams
        return CANONICAL_OPS.linear(*args, **kwargs)
    ops = dataclasses.replace(CANONICAL_OPS, linear=linear)
    with torch.no_grad():
        return compute_logits(model, forward_hidden(model, ids, positions, ops=ops))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3_moe"])  # q/k/v biases; none; MoE MLPs
def test_fused_forward_is_bitwise_the_unfused_one(tmp_path, arch):
    tiny_model(arch, seed=3, **KW).save_pretrained(tmp_path)
    plain, fused = _load(tmp_path), _load(tmp_path)
    fuse_projections(fused)
    layer = fused.model.layers[0]
    q, k, v = (getattr(layer.self_attn, n).weight for n in QKV)
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()  # one tensor, row blocks
    assert v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()
    if arch != "qwen3_moe":
        gate, up = (getattr(layer.mlp, n).weight for n in GATE_UP)
        assert up.data_ptr() == gate.data_ptr() + gate.numel() * gate.element_size()
    ids = torch.randint(0, plain.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    fused_calls, plain_calls = [], []
    assert torch.equal(_logits(fused, ids, fused_calls), _logits(plain, ids, plain_calls))
    saved = 2 if arch == "qwen3_moe" else 3  # per layer: q, k, v -> 1 (gate, up -> 1 in dense MLPs)
    assert len(plain_calls) - len(fused_calls) == saved * plain.config.num_hidden_layers
    assert fused_calls[0] == q.shape[0] + k.shape[0] + v.shape[0]

    # new weights loaded in place (as vLLM's loaders copy them) reach the fused matmuls
    tiny_model(arch, seed=4, **KW).save_pretrained(tmp_path / "new")
    new = _load(tmp_path / "new")
    fused.load_state_dict(new.state_dict())
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    assert torch.equal(_logits(fused, ids), _logits(new, ids))
    assert not torch.equal(_logits(new, ids), _logits(plain, ids))
