"""On CUDA, at Qwen2.5-1.5B widths and the batch sizes of decode and prefill steps:

- adapters whose A matrices are rows of the base weights (kernels.forward.fuse_projections, as the vLLM plugin
  holds hinted adapters) give the bits of the same adapters run from their own tensors: the longer product picks
  other launch configurations (tiles, swapped operands, segment splits), and each output element still reduces
  its own row in the fixed order;
- the rollout's forward (no gradient: each term's expand and epilogue in one launch, kernels.lora_expand_add)
  gives the bits of the trainer's (a gradient: the expand, then the epilogue, as differentiable ops)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import transformers  # noqa: E402
from lora_shared import ALL_LINEAR, random_adapter  # noqa: E402

from kernels.forward import forward_hidden, fuse_projections  # noqa: E402
from kernels.lora import LoraRows  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402


def _setup(tmp_path, tokens):
    tiny_model("qwen2", seed=3, hidden_size=1536, num_heads=12, num_kv_heads=2, intermediate_size=8960,
               num_layers=2, max_positions=2048).save_pretrained(tmp_path)

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    plain, held_model = load(), load()
    fuse_projections(plain)  # q/k/v and gate/up fused in both: only the held A rows differ
    adapters = [random_adapter(plain, 16, ALL_LINEAR, 1), random_adapter(plain, 8, ["q_proj", "v_proj"], 2)]
    gen = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(0, plain.config.vocab_size, (1, tokens), device="cuda", generator=gen)
    positions = torch.arange(tokens, device="cuda").expand_as(ids)
    picks = torch.randint(0, 3, (1, tokens), device="cuda", generator=gen)  # adapter 0, 1 or none per token
    picks[0, 0] = 0  # one token of adapter 0 at least
    return plain, held_model, adapters, ids, positions, picks


@pytest.mark.parametrize("tokens", [1, 64, 256, 1100])
def test_held_shrinks_give_the_own_tensors_bits(tmp_path, tokens):
    plain, held_model, adapters, ids, positions, picks = _setup(tmp_path, tokens)
    held = [a.weights(f"slot{i}", "cuda") for i, a in enumerate(adapters)]
    own = [a.weights(f"own{i}", "cuda") for i, a in enumerate(adapters)]
    fuse_projections(held_model, tuple(held))
    masks = [picks == 0, picks == 1]
    with torch.no_grad():
        a = forward_hidden(held_model, ids, positions, lora=LoraRows(tuple(zip(held, masks))))
        b = forward_hidden(plain, ids, positions, lora=LoraRows(tuple(zip(own, masks))))
        base = forward_hidden(plain, ids, positions)
    assert torch.equal(a, b)
    assert not torch.equal(a[picks == 0], base[picks == 0])  # the adapter matters


@pytest.mark.parametrize("tokens", [1, 256, 1100])
def test_the_fused_expand_gives_the_trainers_bits(tmp_path, tokens):
    plain, held_model, adapters, ids, positions, picks = _setup(tmp_path, tokens)
    held = [a.weights(f"slot{i}", "cuda") for i, a in enumerate(adapters)]
    trained = [a.weights(f"train{i}", "cuda") for i, a in enumerate(adapters)]
    for weights in trained:  # B as a trainer holds it: a parameter with a gradient (a group's B: one tensor)
        for b in [*weights.group_b.values(), *(b for _, b, _ in weights.terms.values() if b._base is None)]:
            b.requires_grad_(True)
    fuse_projections(held_model, tuple(held))
    masks = [picks == 0, picks == 1]
    with torch.no_grad():
        rollout = forward_hidden(held_model, ids, positions, lora=LoraRows(tuple(zip(held, masks))))
    with torch.enable_grad():
        train = forward_hidden(plain, ids, positions, lora=LoraRows(tuple(zip(trained, masks))))
    assert train.requires_grad
    assert torch.equal(rollout, train.detach())
    train.float().square().mean().backward()  # and the gradient reaches the adapter
    assert trained[0].group_b[(0, ("q_proj", "k_proj", "v_proj"))].grad is not None
    assert trained[1].terms[(0, "v_proj")][1].grad is not None
