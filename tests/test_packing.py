"""Packed sequences, token-budget micro-batches and activation checkpointing keep the log-prob bits.

The rollouts come from the native engine on a checkpoint saved to disk; the trainer's model is that
checkpoint loaded with from_pretrained. Every packing, order and budget must give each sequence the
log-probs the rollout reported (and that it gets scored alone); the stock forward's packed path is the
control that differs.
"""
from __future__ import annotations

import socket

import pytest
import torch
from transformers import AutoModelForCausalLM

from recipes.batch import Sample, budget_groups, pack, pack_flat, split_for_ranks
from recipes.config import ConfigError, TrainerConfig, load_config
from rollout_service import Engine, SamplingParams
from rollout_service.tiny_models import tiny_model
from trainer_patch import checkpoint_activations, stock_token_logprobs, token_logprobs

VOCAB = 200
# completions of varied length, as RL batches have them (lengths drawn once, fixed here)
LENGTHS = [3, 141, 9, 1, 277, 18, 5, 260]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tiny_model("qwen2", seed=7, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2,
               vocab_size=VOCAB, max_positions=512).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def samples(checkpoint):
    """Rollouts of varied lengths from the engine, as training samples (advantages alternate in sign)."""
    engine = Engine(checkpoint, fast_path="native", window=8, group=16, device="cpu")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (2 + i % 5,), generator=gen).tolist() for i in range(len(LENGTHS))]
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=100 + i)
              for i, n in enumerate(LENGTHS)]
    rollouts = engine.generate(prompts, params)
    assert [len(r.token_ids) for r in rollouts] == LENGTHS
    return [Sample(p, r.token_ids, r.logprobs, (-1.0) ** i) for i, (p, r) in enumerate(zip(prompts, rollouts))]


def _policy(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)


def _per_sample(mb: dict, logp: torch.Tensor, samples: list[Sample]) -> list[list[float]]:
    """Each sample's generated-token log-probs out of a micro-batch (samples in the batch's order)."""
    flat = logp[mb["loss_mask"]].tolist()
    out, start = [], 0
    for s in samples:
        out.append(flat[start:start + len(s.token_ids)])
        start += len(s.token_ids)
    return out


def _score(model, mb: dict, stock: bool = False) -> torch.Tensor:
    layout = ({"position_ids": mb["position_ids"]} if "position_ids" in mb else
              {"attention_mask": mb["attention_mask"]})
    if stock:
        return stock_token_logprobs(model, mb["input_ids"], **{"attention_mask": None, **layout})
    return token_logprobs(model, mb["input_ids"], temperature=1.0, **layout)


@pytest.mark.parametrize("order", ["as generated", "reversed", "interleaved"])
@pytest.mark.parametrize("budget", [290, 500, 10_000])
def test_packed_logprobs_are_the_rollouts_whatever_the_packing(checkpoint, samples, order, budget):
    model = _policy(checkpoint)
    ordered = {"as generated": samples, "reversed": samples[::-1],
               "interleaved": samples[::2] + samples[1::2]}[order]
    groups = budget_groups(ordered, budget)
    assert all(sum(len(s.prompt_ids) + len(s.token_ids) for s in g) <= budget for g in groups)
    with torch.no_grad():
        for group in groups:
            mb = pack_flat(group)
            assert mb["input_ids"].shape[0] == 1  # one row: no pad token anywhere
            got = _per_sample(mb, _score(model, mb), group)
            assert got == [s.logprobs for s in group]  # bit for bit: exact float equality


def test_packed_equals_padded_and_alone_and_stock_packing_differs(checkpoint, samples):
    """The control: the stock forward (transformers' own padding-free path, SDPA) on the same packed row
    gives other bits than it gives each sequence alone; the canonical forward gives the same."""
    model, stock = _policy(checkpoint), _policy(checkpoint)  # token_logprobs patches its model in place
    stock.config._attn_implementation = "sdpa"
    flat, padded = pack_flat(samples), pack(samples)
    with torch.no_grad():
        canonical_packed = _per_sample(flat, _score(model, flat), samples)
        canonical_padded = _per_sample(padded, _score(model, padded), samples)
        alone = [_per_sample(pack_flat([s]), _score(model, pack_flat([s])), [s])[0] for s in samples]
        stock_packed = _per_sample(flat, _score(stock, flat, stock=True), samples)
        stock_alone = [_per_sample(pack([s]), _score(stock, pack([s]), stock=True), [s])[0] for s in samples]
    assert canonical_packed == canonical_padded == alone == [s.logprobs for s in samples]
    assert stock_packed != stock_alone
    # ...by rounding, not by attending across sequences (which would move log-probs by nats)
    worst = max(abs(a - b) for x, y in zip(stock_packed, stock_alone) for a, b in zip(x, y))
    assert 0 < worst < 0.25


def test_a_packed_row_with_bad_positions_is_refused(checkpoint):
    model = _policy(checkpoint)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="0..L-1"):
        token_logprobs(model, ids, position_ids=torch.tensor([[0, 1, 0, 2, 3]]))
    with pytest.raises(ValueError, match="one row"):
        token_logprobs(model, torch.tensor([[1, 2, 3], [4, 5, 6]]), position_ids=torch.tensor([[0, 1, 0]] * 2))
    with pytest.raises(ValueError, match="no attention_mask"):
        token_logprobs(model, ids, torch.ones_like(ids), position_ids=torch.tensor([[0, 1, 0, 1, 2]]))


def test_budget_groups_refuse_a_sequence_longer_than_the_budget(samples):
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=250"):
        budget_groups(samples, 250)


def test_budgeted_split_keeps_ranks_paired_and_every_token(samples):
    for budget in (290, 600):
        plans, tokens = split_for_ranks(samples, world=2, mini_batches=2, max_tokens_per_micro_batch=budget,
                                        packed=True)
        assert tokens == [sum(LENGTHS[:4]), sum(LENGTHS[4:])]
        for m in range(2):
            assert len(plans[0][m]) == len(plans[1][m])  # FSDP's collectives pair up
            for rank in plans:
                for mb in rank[m]:
                    assert mb["input_ids"].shape[1] <= budget
        scored = sum(int(mb["loss_mask"].sum()) for rank in plans for mini in rank for mb in mini)
        assert scored == sum(LENGTHS)
    few, _ = split_for_ranks(samples, world=1, mini_batches=1, max_tokens_per_micro_batch=600, packed=True)
    many, _ = split_for_ranks(samples, world=1, mini_batches=1, max_tokens_per_micro_batch=290, packed=True)
    assert len(few[0][0]) < len(many[0][0])


def test_activation_checkpointing_keeps_logprobs_and_gradients(checkpoint, samples, monkeypatch):
    """Same log-probs, and the same gradients bit for bit: the recompute is the same forward."""
    import trainer_patch.patch as patch_module
    runs = []
    layer_forward = patch_module.decoder_layer_forward
    monkeypatch.setattr(patch_module, "decoder_layer_forward", lambda *a: runs.append(1) or layer_forward(*a))
    mb = pack_flat(samples)
    grads, values, layer_runs = [], [], []
    for checkpointed in (False, True):
        runs.clear()
        model = _policy(checkpoint).float()
        for p in model.parameters():  # float32 masters, bf16 forward, as the trainer runs it
            p.requires_grad_(True)
        if checkpointed:
            from trainer_patch import patch_model
            checkpoint_activations(patch_model(model))
        logp = _score(model, mb)
        (logp * mb["advantages"] * mb["loss_mask"]).sum().backward()
        values.append(logp.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        layer_runs.append(len(runs))
    layers = 2  # tiny_model's default depth
    assert layer_runs == [layers, 2 * layers]  # checkpointed: each layer's forward ran again in the backward
    assert torch.equal(values[0], values[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert any(bool(g.abs().sum() > 0) for g in grads[0])


def test_checkpointed_moe_records_its_routing_once():
    model = tiny_model("qwen3_moe", vocab_size=64, max_positions=64).float()
    from trainer_patch import patch_model
    checkpoint_activations(patch_model(model))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    layers: list = []
    token_logprobs(model, ids, routing=layers).sum().backward()
    assert len(layers) == model.config.num_hidden_layers


def test_config_fields_for_packing_and_budgets():
    cfg = load_config(None, ["trainer.max_tokens_per_micro_batch=4096", "trainer.activation_checkpointing=true"])
    assert cfg.trainer.max_tokens_per_micro_batch == 4096 and cfg.trainer.activation_checkpointing
    assert TrainerConfig().packing is True
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        load_config(None, ["trainer.max_tokens_per_micro_batch=-1"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("layout", [dict(packing=True, max_tokens_per_micro_batch=290),
                                    dict(packing=True, max_tokens_per_micro_batch=1000,
                                         activation_checkpointing=True),
                                    dict(packing=False, micro_batch_size=3)])
def test_fsdp2_trainer_rank_agrees_with_the_rollouts_in_every_layout(checkpoint, samples, layout):
    """A TrainerRank (FSDP2 fully_shard, gloo, one rank) trains on the packed, budgeted micro-batches: its
    forward reports the rollouts' log-probs bit for bit (KL 0, no mismatched token) before the update."""
    from recipes.trainer import TrainerRank

    cfg = TrainerConfig(num_ranks=1, lr=1e-3, **layout)
    rank = TrainerRank(0, 1, cfg, temperature=1.0)
    try:
        rank.setup("127.0.0.1", _free_port(), _policy(checkpoint))
        plans, tokens = split_for_ranks(samples, 1, 1, cfg.micro_batch_size, 0, cfg.max_tokens_per_micro_batch,
                                        cfg.packing)
        result = rank.train_step(plans[0], tokens)
    finally:
        rank.close()
    parts = result["agreement"]
    assert sum(p["tokens"] for p in parts) == sum(LENGTHS)
    assert sum(p["mismatched"] for p in parts) == 0 and max(p["max_abs"] for p in parts) == 0.0
    assert result["tokens"] == sum(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    assert result["grad_norm"][0] > 0
