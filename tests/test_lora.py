"""LoRA with exact rollouts: an adapter trained with PEFT through the canonical forward, saved as a PEFT
checkpoint, served by the native engine beside other adapters, reports the trainer's log-probs bit for bit;
stock PEFT's forward does not; bad adapters are refused and change nothing."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from lora_shared import ALL_LINEAR, ATTENTION, base_model, logprob_bits, rollout_scores, trained_adapter_model  # noqa: E402
from rollout_service.engine.engine import Engine  # noqa: E402
from rollout_service.lora import (AdapterError, LoraAdapter, adapter_from_model, load_adapter,  # noqa: E402
                                  push_digest, save_adapter)
from rollout_service.params import InvalidRequestError, SamplingParams  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402

PROMPTS = [[5, 9, 14, 3], [7, 7, 2], [40, 41, 42, 43, 44, 45], [11]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    tiny_model("qwen2", seed=0).save_pretrained(path)
    return path


def _params(adapter, seed=0, max_tokens=10):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, adapter=adapter)


def _generate(engine, requests):
    """requests: [(prompt, params)] submitted together, so they share the engine's batches."""
    ids = [engine.add_request(p, params) for p, params in requests]
    done = {}
    while engine.has_unfinished():
        done.update(dict(engine.step()))
    return [done[i] for i in ids]


# q/k/v and gate/up read one input: an adapter on all of a group shrinks once for it (kernels.lora.LoraWeights
# .groups); on part of one (q_proj and v_proj, up_proj alone), each projection shrinks on its own
@pytest.mark.parametrize("r, targets", [(1, ATTENTION), (8, ALL_LINEAR), (64, ATTENTION),
                                        (4, ["q_proj", "v_proj", "up_proj"])],
                         ids=["r1-attention", "r8-all-linear", "r64-attention", "r4-part-of-each-group"])
def test_engine_rollouts_with_an_adapter_are_the_trainers_logprobs(checkpoint, tmp_path, r, targets):
    trained = trained_adapter_model(checkpoint, r, targets)
    adapter = adapter_from_model(trained)
    assert all(float(t.abs().max()) > 0 for k, t in adapter.tensors.items() if "lora_B" in k)  # B != 0
    path = save_adapter(adapter, tmp_path / "adapter")
    engine = Engine(str(checkpoint), window=4, group=2)
    engine.load_adapter("policy", path)
    requests = [(p, _params("policy", seed=i)) for i, p in enumerate(PROMPTS)]
    rollouts = _generate(engine, requests)
    assert logprob_bits(rollouts) == rollout_scores(trained, rollouts)
    # the adapter matters: the base model scores these tokens differently
    assert rollout_scores(base_model(checkpoint), rollouts) != logprob_bits(rollouts)


def test_a_groups_a_matrices_are_one_tensor_that_in_place_copies_reach(checkpoint):
    """The forward's view of an adapter holds q/k/v's (and gate/up's) A as row blocks of one tensor, its
    terms' A being views of it: a copy into a term's A in place (how a CUDA graph's adapter is refreshed)
    changes what the group's one shrink reads."""
    from kernels.lora import GATE_UP, QKV
    weights = adapter_from_model(trained_adapter_model(checkpoint, 4, ALL_LINEAR)).weights("a", "cpu")
    fused, ranks = weights.groups[(0, QKV)]
    assert ranks == [4, 4, 4] and (0, GATE_UP) in weights.groups
    assert torch.equal(fused, torch.cat([weights.terms[(0, n)][0] for n in QKV]))
    weights.terms[(0, "k_proj")][0].copy_(torch.full((4, fused.shape[1]), 0.5))
    assert torch.equal(fused[4:8], torch.full((4, fused.shape[1]), 0.5, dtype=torch.bfloat16))
    partial = adapter_from_model(trained_adapter_model(checkpoint, 4, ["q_proj", "v_proj"])).weights("b", "cpu")
    assert partial.groups == {}


def test_the_trainer_trains_only_the_adapter(checkpoint):
    before = base_model(checkpoint).state_dict()
    trained = trained_adapter_model(checkpoint, 4, ALL_LINEAR)
    trainable = [n for n, p in trained.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    after = {k.replace(".base_layer", ""): v for k, v in trained.state_dict().items() if "lora_" not in k}
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) and after[k].dtype == torch.bfloat16 for k in before)


def test_several_adapters_in_one_batch_each_exact(checkpoint):
    """One engine, one base, two adapters and the base model in the same batches: every request's
    log-probs are its own adapter's (or the base's), bit for bit, and equal to the request served alone."""
    a = trained_adapter_model(checkpoint, 8, ATTENTION, seed=1)
    b = trained_adapter_model(checkpoint, 4, ALL_LINEAR, seed=2)
    engine = Engine(str(checkpoint), window=4, group=3)
    engine.load_adapter("a", adapter_from_model(a))
    engine.load_adapter("b", adapter_from_model(b))
    names = ["a", "b", None, "a", "b", None]
    requests = [(PROMPTS[i % len(PROMPTS)], _params(n, seed=i)) for i, n in enumerate(names)]
    mixed = _generate(engine, requests)
    scorer = {"a": a, "b": b, None: base_model(checkpoint)}
    for name, rollout in zip(names, mixed):
        assert logprob_bits([rollout]) == rollout_scores(scorer[name], [rollout])
    alone = [_generate(engine, [req])[0] for req in requests[:3]]
    assert logprob_bits(alone) == logprob_bits(mixed[:3])
    with pytest.raises(InvalidRequestError, match="unknown adapter 'c'.*\\['a', 'b'\\]"):
        engine.add_request(PROMPTS[0], _params("c"))


def test_stock_peft_forward_differs_from_the_rollouts(checkpoint, tmp_path):
    """The control: the adapter loaded the stock way (PeftModel.from_pretrained on the unpatched Hugging
    Face model) scores the same tokens close to, but not bit for bit as, the engine reported them."""
    from peft import PeftModel
    trained = trained_adapter_model(checkpoint, 8, ALL_LINEAR)
    path = save_adapter(adapter_from_model(trained), tmp_path / "adapter")
    engine = Engine(str(checkpoint), window=4, group=2)
    engine.load_adapter("policy", path)
    rollouts = _generate(engine, [(p, _params("policy", seed=i, max_tokens=16)) for i, p in enumerate(PROMPTS)])
    stock = PeftModel.from_pretrained(base_model(checkpoint, patched=False), str(path)).eval()
    diffs = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_token_ids + r.token_ids])
            logp = torch.log_softmax(stock(input_ids=ids).logits.float(), dim=-1)[0, :-1]
            got = logp.gather(1, ids[0, 1:, None])[len(r.prompt_token_ids) - 1:, 0]
            diffs.append((got - torch.tensor(r.logprobs)).abs())
    diff = torch.cat(diffs)
    assert float(diff.max()) > 0, "stock PEFT matched the canonical forward bit for bit"
    assert float(diff.max()) < 0.5, "the stock forward is not running the same adapter"


def test_peft_checkpoints_round_trip(checkpoint, tmp_path):
    """Ours loads in PEFT, and PEFT's own save_pretrained loads in ours, with the same tensors."""
    from peft import LoraConfig, PeftModel, get_peft_model
    trained = trained_adapter_model(checkpoint, 4, ATTENTION)
    ours = adapter_from_model(trained)
    path = save_adapter(ours, tmp_path / "ours")
    peft_model = PeftModel.from_pretrained(base_model(checkpoint, patched=False), str(path))
    back = adapter_from_model(peft_model)
    assert set(back.tensors) == set(ours.tensors)
    assert all(torch.equal(back.tensors[k].float(), ours.tensors[k].float()) for k in ours.tensors)
    # an adapter trained elsewhere: PEFT's own model and checkpoint
    theirs = get_peft_model(base_model(checkpoint, patched=False),
                            LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "down_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    theirs.save_pretrained(str(tmp_path / "theirs"))
    loaded = load_adapter(tmp_path / "theirs")
    assert loaded.r == 4 and loaded.scale == 4.0 and set(loaded.target_modules) == {"q_proj", "down_proj"}
    engine = Engine(str(checkpoint), window=4, group=2)
    engine.load_adapter("theirs", tmp_path / "theirs")
    rollouts = _generate(engine, [(p, _params("theirs", seed=i)) for i, p in enumerate(PROMPTS)])
    scorer = PeftModel.from_pretrained(base_model(checkpoint), str(tmp_path / "theirs")).base_model.model
    assert logprob_bits(rollouts) == rollout_scores(scorer, rollouts)


def _variant(adapter: LoraAdapter, **changes) -> LoraAdapter:
    fields = dict(r=adapter.r, alpha=adapter.alpha, target_modules=adapter.target_modules,
                  tensors=dict(adapter.tensors), use_rslora=adapter.use_rslora)
    fields.update(changes)
    return LoraAdapter(**fields)


def test_bad_adapters_are_refused_and_change_nothing(checkpoint, tmp_path):
    trained = trained_adapter_model(checkpoint, 8, ATTENTION)
    good = adapter_from_model(trained)
    engine = Engine(str(checkpoint), window=4, group=2, max_lora_rank=16)
    base_digest = engine.weights_digest()
    engine.load_adapter("policy", good, expected_digest=push_digest(good.digest(), base_digest))
    requests = [(p, _params("policy", seed=i)) for i, p in enumerate(PROMPTS)]
    served = logprob_bits(_generate(engine, requests))
    version = engine.weight_version

    q = "model.layers.0.self_attn.q_proj.lora_A.weight"
    wider = tiny_model("qwen2", seed=0, hidden_size=96)  # another base: its projections are wider
    from peft import LoraConfig, inject_adapter_in_model
    inject_adapter_in_model(LoraConfig(r=8, target_modules=ATTENTION, lora_dropout=0.0), wider)
    nan = dict(good.tensors)
    nan[q] = nan[q].clone()
    nan[q][0, 0] = float("nan")
    bad = {
        "wrong base": (adapter_from_model(wider), "expected .* a different base model or rank"),
        "wrong rank": (_variant(good, r=4), "shape .* rank 4"),
        "rank over the engine's limit": (_variant(good, r=32, tensors={}), "rank 32 is outside 1..16"),
        "absent target module": (_variant(good, target_modules=(*good.target_modules, "w1")), "\\['w1'\\] are not"),
        "missing half": (_variant(good, tensors={k: v for k, v in good.tensors.items() if k != q}),
                         "incomplete"),
        "non-finite": (_variant(good, tensors=nan), "must be finite"),
    }
    for what, (adapter, match) in bad.items():
        with pytest.raises(AdapterError, match=match):
            engine.load_adapter("policy", adapter)
    with pytest.raises(AdapterError, match="digest of adapter \\+ base"):
        engine.load_adapter("policy", _variant(good, alpha=good.alpha), expected_digest="0" * 32)
    other_base = push_digest(good.digest(), "a digest of other base weights")
    with pytest.raises(AdapterError, match="trained on other base weights"):
        engine.load_adapter("policy", good, expected_digest=other_base)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.load_adapter("policy", tmp_path / "nowhere")
    assert engine.weight_version == version
    assert logprob_bits(_generate(engine, requests)) == served


def test_a_replaced_adapter_is_a_new_weight_version(checkpoint):
    first = trained_adapter_model(checkpoint, 8, ATTENTION, steps=2)
    second = trained_adapter_model(checkpoint, 8, ATTENTION, steps=4)
    engine = Engine(str(checkpoint), window=4, group=2)
    engine.load_adapter("policy", adapter_from_model(first), version=1)
    ids = [engine.add_request(p, _params("policy", seed=i, max_tokens=12)) for i, p in enumerate(PROMPTS)]
    done = dict(engine.step())
    engine.load_adapter("policy", adapter_from_model(second), version=2)  # requests are running
    while engine.has_unfinished():
        done.update(dict(engine.step()))
    rollouts = [done[i] for i in ids]
    for r in rollouts:
        assert set(r.weight_versions) <= {1, 2} and r.weight_versions[-1] == 2
    # every token's log-prob is its own version's: score each token under the adapter that produced it
    for r in rollouts:
        for model, version in ((first, 1), (second, 2)):
            scores = rollout_scores(model, [r])[0]
            mine = logprob_bits([r])[0]
            assert all(scores[j] == mine[j] for j, v in enumerate(r.weight_versions) if v == version)
