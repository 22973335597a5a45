"""Packed sequences, token-budget micro-batches and activation checkpointing keep the log-prob bits.

The rollouts come from the native engine on a checkpoint saved to disk; the trainer's model is that
checkpoint loaded with from_pretrained. Every packing, order and budget must give each sequence the
log-probs the rollout reported (and that it gets scored alone); the stock forward's packed path is the
control that differs.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from packing_shared import per_sample, rollout_samples, score, train_step_in_process
from recipes.batch import budget_groups, pack, pack_flat, split_for_ranks
from recipes.config import BatchingConfig, ConfigError, OptimizerConfig, TrainerConfig, load_config
from rollout_service.tiny_models import tiny_model
from trainer_patch import checkpoint_activations, patch_model, token_logprobs

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
    return rollout_samples(checkpoint, LENGTHS, VOCAB, "cpu")


def _policy(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)


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
            got = per_sample(mb, score(model, mb), group)
            assert got == [s.logprobs for s in group]  # bit for bit: exact float equality


def test_packed_equals_padded_and_alone_and_stock_packing_differs(checkpoint, samples):
    """The control: the stock forward (transformers' own padding-free path, SDPA) on the same packed row
    gives other bits than it gives each sequence alone; the canonical forward gives the same."""
    model, stock = _policy(checkpoint), _policy(checkpoint)  # token_logprobs patches its model in place
    stock.config._attn_implementation = "sdpa"
    flat, padded = pack_flat(samples), pack(samples)
    with torch.no_grad():
        canonical_packed = per_sample(flat, score(model, flat), samples)
        canonical_padded = per_sample(padded, score(model, padded), samples)
        alone = [per_sample(pack_flat([s]), score(model, pack_flat([s])), [s])[0] for s in samples]
        stock_packed = per_sample(flat, score(stock, flat, stock=True), samples)
        stock_alone = [per_sample(pack([s]), score(stock, pack([s]), stock=True), [s])[0] for s in samples]
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


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_keeps_logprobs_and_gradients(checkpoint, samples, monkeypatch, every):
    """Same log-probs, and the same gradients bit for bit: the recompute is the same forward. every = 2
    (trainer.batching.checkpoint_every) checkpoints layer 0 only of the two, so only it runs again."""
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
            checkpoint_activations(patch_model(model), every)
        logp = score(model, mb)
        (logp * mb["advantages"] * mb["loss_mask"]).sum().backward()
        values.append(logp.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        layer_runs.append(len(runs))
    layers = 2  # tiny_model's default depth
    # checkpointed: each checkpointed layer's forward ran again in the backward
    assert layer_runs == [layers, layers + -(-layers // every)]
    assert torch.equal(values[0], values[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert any(bool(g.abs().sum() > 0) for g in grads[0])


def test_stock_model_checkpoints_every_nth_layer_through_transformers(checkpoint):
    """The stock arm's checkpointing is transformers' own, layer by layer: with every = 2 only layers 0, 2, ...
    have it on, and the gradients are those of the model without it."""
    grads = []
    for every in (None, 1, 2):
        model = _policy(checkpoint).float()
        if every is not None:
            checkpoint_activations(model, every)
            assert [layer.gradient_checkpointing for layer in model.model.layers] == [
                i % every == 0 for i in range(len(model.model.layers))]
        model.train()
        ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
        model(ids, labels=ids).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))
    with pytest.raises(ValueError, match="at least 1"):
        checkpoint_activations(_policy(checkpoint), 0)


def test_checkpointed_moe_records_its_routing_once():
    model = tiny_model("qwen3_moe", vocab_size=64, max_positions=64).float()
    checkpoint_activations(patch_model(model))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    layers: list = []
    token_logprobs(model, ids, routing=layers).sum().backward()
    assert len(layers) == model.config.num_hidden_layers


def test_config_fields_for_packing_and_budgets():
    cfg = load_config(None, ["trainer.batching.max_tokens_per_micro_batch=4096",
                             "trainer.batching.activation_checkpointing=true"])
    batching = cfg.trainer.batching
    assert batching.max_tokens_per_micro_batch == 4096 and batching.activation_checkpointing
    assert TrainerConfig().batching.packing is True
    with pytest.raises(ConfigError, match="trainer.batching.max_tokens_per_micro_batch"):
        load_config(None, ["trainer.batching.max_tokens_per_micro_batch=-1"])


@pytest.mark.parametrize("layout", [dict(packing=True, max_tokens_per_micro_batch=290),
                                    dict(packing=True, max_tokens_per_micro_batch=1000,
                                         activation_checkpointing=True),
                                    dict(packing=False, micro_batch_size=3)])
def test_fsdp2_trainer_rank_agrees_with_the_rollouts_in_every_layout(checkpoint, samples, layout):
    """A TrainerRank (FSDP2 fully_shard, gloo, one rank) trains on the packed, budgeted micro-batches: its
    forward reports the rollouts' log-probs bit for bit (KL 0, no mismatched token) before the update."""
    cfg = TrainerConfig(num_ranks=1, optimizer=OptimizerConfig(lr=1e-3), batching=BatchingConfig(**layout))
    result = train_step_in_process(cfg, _policy(checkpoint), samples)
    parts = result["agreement"]
    assert sum(p["tokens"] for p in parts) == sum(LENGTHS)
    assert sum(p["mismatched"] for p in parts) == 0 and max(p["max_abs"] for p in parts) == 0.0
    assert result["tokens"] == sum(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    assert result["grad_norm"][0] > 0
    # the step's sums, read from the device once after it: at ratio 1 each token's loss is -advantage
    assert result["loss_sum"] == -sum(s.advantage * len(s.token_ids) for s in samples)
    assert result["kept_tokens"] == sum(LENGTHS) and result["clipped_tokens"] == 0
    assert result["entropy_sum"] == pytest.approx(-sum(sum(s.logprobs) for s in samples), rel=1e-12)


def _autograd_node_names(root) -> list[str]:
    seen, stack, names = set(), [root.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def test_a_packed_row_attends_in_one_call_a_layer_with_the_per_sequence_bits(checkpoint, samples, monkeypatch):
    """A packed row's sequences attend in one canonical call a layer (kernels.attention_sequences), one
    autograd node a layer for the backward, not one per sequence. An op set without that call attends
    sequence by sequence: both give the same log-prob bits, and gradients of the same formula."""
    import dataclasses

    from kernels import forward as F
    model = patch_model(_policy(checkpoint).float())
    mb = pack_flat(samples)
    logp = score(model, mb)
    names = _autograd_node_names(logp)
    assert names.count("_PackedAttentionBackward") == model.config.num_hidden_layers
    assert "_CanonicalAttentionBackward" not in names
    (logp * mb["loss_mask"]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    per_sequence = dataclasses.replace(F.CANONICAL_OPS, attention_sequences=None)
    monkeypatch.setattr("trainer_patch.patch.CANONICAL_OPS", per_sequence)
    alone = score(model, mb)
    names = _autograd_node_names(alone)
    assert names.count("_CanonicalAttentionBackward") == model.config.num_hidden_layers * len(samples)
    assert torch.equal(alone, logp)
    (alone * mb["loss_mask"]).sum().backward()
    for name, p in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6)
