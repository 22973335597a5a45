"""Qwen3-MoE in the canonical forward (kernels/moe.py): routing follows the model's own rule, a token's
experts and log-probs do not depend on its batch, prefix length or chunking, and the engine's
rollouts (verified with DVR, invariant; chunked prefill; preemption; alone or in a mixed batch) equal
the trainer's bit for bit, with the routing the engine recorded while generating
(return_routed_experts) equal to the trainer's token for token. The stock HF model and the `off` fast
path flip routing decisions (the negative controls).
Loading routes (from_pretrained bf16 / fp32, FSDP2 with MixedPrecisionPolicy) are in
test_loading_routes.py (checkpoint "qwen3_moe")."""
import dataclasses
import pickle
import random

import pytest
import torch

import trainer_patch
from conftest import assert_bitwise_equal
from kernels.forward import CANONICAL_OPS, forward_hidden
from kernels.moe import group_by_expert, moe_forward, moe_spec, route
from rollout_service import Engine, InvalidRequestError, SamplingParams
from rollout_service.tiny_models import tiny_model

VOCAB = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("zerokl-qwen3-moe")
    tiny_model("qwen3_moe", seed=3, dtype=torch.float32, num_layers=3).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def trainer(checkpoint):
    from transformers import AutoModelForCausalLM
    return trainer_patch.patch_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16))


def _routing(model, ids: list[int]) -> list[torch.Tensor]:
    routing = []
    with torch.no_grad():
        forward_hidden(model, torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), routing=routing)
    return [r[0] for r in routing]  # per layer [T, k]


def test_routing_follows_the_models_rule():
    """Same experts as the HF router on the same inputs (softmax, top-k, norm_topk_prob), output close."""
    model = tiny_model("qwen3_moe", seed=1)
    spec, block = moe_spec(model.config), model.model.layers[0].mlp
    x = torch.randn(400, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        ids, weights = route(x, block.gate.weight, spec, CANONICAL_OPS)
        assert torch.equal(hf_ids.sort(-1).values, ids)
        assert torch.allclose(weights.sum(-1), torch.ones(400))  # norm_topk_prob
        ours = moe_forward(block, x.unsqueeze(0), spec, CANONICAL_OPS, lambda t: t.to(torch.bfloat16))
        torch.testing.assert_close(ours[0].float(), block(x.unsqueeze(0))[0].float(), atol=2e-2, rtol=2e-2)


def test_group_by_expert_sorts_slots_stably_with_offsets():
    """The grouped path's layout (kernels/triton/moe.py on CUDA): slot t * k + j sorted by expert id,
    ties in slot order, and each expert's row range; on the CPU the experts run as the loop."""
    groups = group_by_expert(torch.tensor([[0, 3], [1, 3], [0, 2], [2, 3]]), num_experts=5)
    assert groups.slot.tolist() == [0, 4, 2, 5, 6, 1, 3, 7]
    assert groups.token.tolist() == [0, 2, 1, 2, 3, 0, 1, 3]
    assert groups.offsets.tolist() == [0, 2, 3, 5, 8, 8]
    model = tiny_model("qwen3_moe", seed=1)
    with pytest.raises(ValueError, match="grouped experts need"):
        moe_forward(model.model.layers[0].mlp, torch.zeros(1, 2, 64, dtype=torch.bfloat16), moe_spec(model.config),
                    CANONICAL_OPS, lambda t: t.to(torch.bfloat16), grouped=True)


def test_routing_and_logprobs_do_not_depend_on_batch_or_prefix(trainer):
    rng = random.Random(4)
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (70, 33, 5, 51)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    batched = trainer_patch.token_logprobs(trainer, ids, mask)
    for i, s in enumerate(seqs):
        alone = trainer_patch.token_logprobs(trainer, torch.tensor([s]))
        assert_bitwise_equal(alone[0], batched[i, :len(s) - 1], f"sequence {i} alone vs batched")
    full = _routing(trainer, seqs[0])
    for cut in (7, 20, 33, 50):
        prefix = _routing(trainer, seqs[0][:cut])
        assert all(torch.equal(a[:cut], b) for a, b in zip(full, prefix)), f"routing changed at prefix {cut}"


def test_negative_control_stock_moe_flips_routing_with_the_prefix_length():
    """Measured on CPU: the stock HF model's router inputs change with the sequence length (SDPA), and
    some tokens change experts."""
    model = tiny_model("qwen3_moe", seed=1, num_layers=4)
    seen = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out: seen.append(out[2].sort(-1).values))
    g = torch.Generator().manual_seed(5)
    flips = 0
    with torch.no_grad():
        for _ in range(20):
            ids = torch.randint(0, VOCAB, (1, 96), generator=g)
            seen.clear()
            model(input_ids=ids)
            full = list(seen)
            for cut in (7, 20, 33, 50, 77):
                seen.clear()
                model(input_ids=ids[:, :cut])
                flips += sum(int((a[:cut] != b).any(-1).sum()) for a, b in zip(full, seen))
    assert flips > 0, "the stock MoE never changed a routing decision: this control cannot fail"


def _trainer_scores(trainer, prompt: list[int], tokens: list[int], temperature: float):
    """(log-probs, routing [token][layer][k]) of the generated tokens, from one trainer forward."""
    routing = []
    with torch.no_grad():
        lp = trainer_patch.token_logprobs(trainer, torch.tensor([prompt + tokens]), temperature=temperature,
                                          routing=routing)
    rows = slice(len(prompt) - 1, len(prompt) - 1 + len(tokens))  # row t scores token t + 1
    return lp[0, rows].tolist(), torch.stack(routing, dim=2)[0, rows].tolist()


def _prompts_and_params(mode: str, n: int = 10, seed: int = 6):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(n)]
    params = [SamplingParams(max_tokens=12, temperature=[0.0, 0.8][i % 2], seed=50 + i, determinism=mode,
                             return_routed_experts=True) for i in range(n)]
    return prompts, params


class _WrongSecondProposal:
    """The engine's fast path with each verified window's second proposal changed: every window rolls
    back, and the verifier's own token (and its routing) replaces the rejected one."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def propose(self, batch):
        out = self.inner.propose(batch)
        for r, p in zip(batch, out):
            if r.params.determinism == "verified" and len(p.token_ids) > 1:
                p.token_ids[1] = (p.token_ids[1] + 1) % VOCAB
        return out

    def release(self, request_id):
        self.inner.release(request_id)


@pytest.mark.parametrize("mode", ["verified", "invariant"])
def test_engine_rollouts_equal_the_trainer_with_the_recorded_routing(checkpoint, trainer, mode):
    prompts, params = _prompts_and_params(mode)
    # mixed in: requests that record no routing, and `off` ones on the fast path, in the same steps
    extra_prompts = [p[::-1] for p in prompts[:4]]
    extra = [SamplingParams(max_tokens=12, temperature=0.8, seed=90 + i, determinism=["off", mode][i % 2])
             for i in range(4)]
    # DVR on every verified step; a prefill budget of 24 tokens (chunked prefill) and a cache of 12
    # blocks of 16 (preemption)
    engine = Engine(checkpoint, window=4, group=4, max_prefill_tokens=24, kv_cache_tokens=192, max_num_seqs=6,
                    verified_decode="dvr")
    engine.fast_path = _WrongSecondProposal(engine.fast_path)
    out = engine.generate(prompts + extra_prompts, params + extra)
    batch = out[:len(prompts)]
    assert engine.num_preemptions > 0
    if mode == "verified":
        assert sum(r.stats.verify_windows for r in batch) > 0 and sum(r.stats.rollbacks for r in batch) > 0
    assert all(r.ok and r.routed_experts is None for r in out[len(prompts):])
    alone = [Engine(checkpoint, window=4, group=4).generate([p], [q])[0] for p, q in zip(prompts[:3], params[:3])]
    assert [(r.token_ids, r.logprobs, r.routed_experts) for r in alone] == \
        [(r.token_ids, r.logprobs, r.routed_experts) for r in batch[:3]]
    for prompt, p, r in zip(prompts, params, batch):
        assert r.ok and len(r.token_ids) == 12, r.error
        logprobs, routing = _trainer_scores(trainer, prompt, r.token_ids, p.temperature)
        assert r.logprobs == logprobs
        assert len(r.routed_experts) == 12 and all(len(t) == 3 and len(t[0]) == 2 for t in r.routed_experts)
        assert r.routed_experts == routing  # token for token, layer for layer


def test_negative_control_off_fast_path_routes_some_tokens_differently(checkpoint, trainer):
    """`off` records the fast path's routing (ordinary torch ops, bf16 router logits on CPU): some
    decisions differ from the trainer's, so the comparison above can fail."""
    prompts, params = _prompts_and_params("off")
    out = Engine(checkpoint, window=4, group=4, max_prefill_tokens=24).generate(prompts, params)
    flips = 0
    for prompt, p, r in zip(prompts, params, out):
        assert r.ok and len(r.routed_experts) == len(r.token_ids)
        _, routing = _trainer_scores(trainer, prompt, r.token_ids, p.temperature)
        flips += sum(a != b for got, want in zip(r.routed_experts, routing) for a, b in zip(got, want))
    assert flips > 0, "the off fast path routed every token as the trainer: this control cannot fail"


def test_routing_is_none_unless_asked_and_for_dense_models():
    """A dense model records nothing (None, documented on Rollout.routed_experts); a bad flag is refused."""
    flagged = SamplingParams(max_tokens=4, temperature=0.0, return_routed_experts=True)
    for mode in ("verified", "invariant", "off"):
        params = [dataclasses.replace(flagged, determinism=mode), SamplingParams(max_tokens=4, determinism=mode,
                                                                                  temperature=0.0)]
        dense, moe = (Engine(f"tiny:{arch}", window=2, group=2).generate([[1, 2, 3]] * 2, params)
                      for arch in ("qwen2", "qwen3_moe"))
        assert all(r.ok and r.routed_experts is None for r in dense)
        assert len(moe[0].routed_experts) == 4 and moe[1].routed_experts is None
    with pytest.raises(InvalidRequestError, match="return_routed_experts must be a bool"):
        SamplingParams(max_tokens=4, temperature=0.0, return_routed_experts=1)


def test_routed_experts_survive_pickling():
    """Ray moves Rollouts between actors by pickling; the field must come along."""
    [r] = Engine("tiny:qwen3_moe", window=2, group=2).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, return_routed_experts=True))
    again = pickle.loads(pickle.dumps(r))
    assert again.routed_experts == r.routed_experts and len(r.routed_experts) == 3


def test_stock_scoring_records_the_routing_the_stock_model_used(checkpoint):
    """stock_token_logprobs(routing=[...]) gives, per MoE layer, the experts the unpatched model's own routers
    picked in that forward (its gates' top-k, read by a hook), padded rows and packed rows alike, in the
    canonical routing's layout; the stock recipe arm sets them beside the rollout's. A dense model refuses."""
    from transformers import AutoModelForCausalLM
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    picked = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, inp, out: picked.append(out[2].sort(-1).values))
             for layer in stock.model.layers]
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    packed, pos = ids.reshape(1, -1), torch.cat([torch.arange(24), torch.arange(24)]).unsqueeze(0)
    with torch.no_grad():
        for layout in ({"attention_mask": mask}, {"attention_mask": None, "position_ids": pos}):
            rows = packed if "position_ids" in layout else ids
            picked.clear()
            routing = []
            trainer_patch.stock_token_logprobs(stock, rows, routing=routing, **layout)
            assert len(routing) == len(stock.model.layers) == len(picked)
            for got, want in zip(routing, picked):
                assert got.shape == (*rows.shape, stock.config.num_experts_per_tok)
                assert torch.equal(got.reshape(-1, got.shape[-1]), want)
    for hook in hooks:
        hook.remove()
    # the canonical routing's layout: the same model patched decides (nearly) alike, token for token
    canonical = trainer_patch.patch_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16))
    ours, theirs = [], []
    with torch.no_grad():
        trainer_patch.token_logprobs(canonical, ids, mask, routing=ours)
        trainer_patch.stock_token_logprobs(stock, ids, mask, routing=theirs)
    real = mask.bool()
    same = [(a == b).all(-1)[real].float().mean().item() for a, b in zip(ours, theirs)]
    assert [a.shape for a in ours] == [b.shape for b in theirs] and min(same) > 0.8, same
    dense = tiny_model("qwen2", seed=0)
    with pytest.raises(ValueError, match="MoE models only"):
        trainer_patch.stock_token_logprobs(dense, ids, mask, routing=[])
