"""kernels.forward.fuse_projections (the vLLM plugin's model): q/k/v and gate/up as one matmul each
give the unfused forward's bits, and loads into the fused parameters in place keep the fusion."""
import dataclasses

import pytest
import torch
import transformers

from kernels.forward import CANONICAL_OPS, GATE_UP, QKV, compute_logits, forward_hidden, fuse_projections
from rollout_service.tiny_models import tiny_model

from lora_shared import random_adapter  # noqa: E402

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


def _lora_logits(model, ids, rows, calls=None):
    positions = torch.arange(ids.shape[1]).expand_as(ids)

    def linear(*args, **kwargs):
        if calls is not None:
            calls.append(args[1].shape[0])
        return CANONICAL_OPS.linear(*args, **kwargs)

    def expand_add(base, h, b, scale, mask, widths=None):  # expands and their epilogue: one product, through B
        if calls is not None:
            calls.append(b.shape[0])
        return CANONICAL_OPS.lora_expand_add(base, h, b, scale, mask, widths)
    ops = dataclasses.replace(CANONICAL_OPS, linear=linear, lora_expand_add=expand_add)
    with torch.no_grad():
        return compute_logits(model, forward_hidden(model, ids, positions, ops=ops, lora=rows))


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     ("q_proj", "v_proj")])  # whole groups; part of one (a block per projection)
def test_adapters_held_in_the_base_weights_give_their_own_bits(tmp_path, targets):
    """fuse_projections with adapters: their A matrices become rows of the base products, every shrink comes
    out of its base product (fewer matmuls), and the logits are the unfused forward's with the same adapters,
    bit for bit, for tokens of either adapter and of none; values copied in place later reach the products."""
    from kernels.lora import LoraRows
    tiny_model("qwen2", seed=3, **KW).save_pretrained(tmp_path)
    plain, fused = _load(tmp_path), _load(tmp_path)
    adapters = [random_adapter(plain, r, targets, seed) for r, seed in ((4, 1), (8, 2))]
    held = [a.weights(f"slot{i}", "cpu") for i, a in enumerate(adapters)]
    own = [a.weights(f"own{i}", "cpu") for i, a in enumerate(adapters)]
    fuse_projections(fused, tuple(held))
    a = fused.model.layers[0].self_attn
    assert held[1].terms[(0, "q_proj")][0].untyped_storage().data_ptr() == a.q_proj.weight.untyped_storage().data_ptr()
    ids = torch.randint(0, plain.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    masks = [torch.zeros(3, 17, dtype=torch.bool) for _ in held]
    masks[0][0], masks[1][1] = True, True  # row 2: no adapter

    def rows(weights):
        return LoraRows(tuple(zip(weights, masks)))
    fused_calls, plain_calls = [], []
    out = _lora_logits(fused, ids, rows(held), fused_calls)
    assert torch.equal(out, _lora_logits(plain, ids, rows(own), plain_calls))
    assert not torch.equal(out[0], _lora_logits(plain, ids, None)[0])  # the adapters matter
    # per layer: the plain model's 7 base products, a shrink per adapter and group (q/k/v, o, gate/up, down for
    # whole groups; q and v apart otherwise) and an expand per term; the fused model's 4 base products, no shrink,
    # and an expand per adapter and group (whole groups: one op for q/k/v's terms, one for gate/up's)
    layers, whole = plain.config.num_hidden_layers, len(targets) == 7
    assert len(plain_calls) == layers * (7 + len(held) * (4 if whole else 2) + len(held) * len(targets))
    assert len(fused_calls) == layers * (4 + len(held) * (4 if whole else 2))
    # new adapter values copied in place (as a load into a slot copies them) reach the base products
    with torch.no_grad():
        for weights in (held[0], own[0]):
            for a_rows, b, _ in weights.terms.values():
                a_rows.mul_(2)
    changed = _lora_logits(fused, ids, rows(held))
    assert torch.equal(changed, _lora_logits(plain, ids, rows(own)))
    assert not torch.equal(changed[0], out[0]) and torch.equal(changed[2], out[2])
