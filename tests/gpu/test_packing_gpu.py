"""On CUDA: packed rows, token budgets and activation checkpointing keep the log-prob bits (Triton kernels).

Rollouts of 30 to 1,900 tokens come from the native engine on CUDA; the trainer's model is the same
checkpoint loaded with from_pretrained. The stock forward (SDPA, cuBLAS) is the control: packing changes
its bits, since cuBLAS picks its kernels by the number of rows.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from transformers import AutoModelForCausalLM  # noqa: E402

from packing_shared import per_sample, rollout_samples, score, train_step_in_process  # noqa: E402
from recipes.batch import budget_groups, pack, pack_flat  # noqa: E402
from recipes.config import BatchingConfig, OptimizerConfig, TrainerConfig  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from trainer_patch import checkpoint_activations, patch_model  # noqa: E402

VOCAB = 4096
LENGTHS = [30, 1900, 250, 7, 1024, 400, 90, 1300]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tiny_model("qwen2", seed=5, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2,
               num_layers=4, vocab_size=VOCAB, max_positions=2048).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def samples(checkpoint):
    return rollout_samples(checkpoint, LENGTHS, VOCAB, "cuda")


def _policy(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda()


@pytest.mark.parametrize("budget", [2000, 4096, 100_000])
def test_packed_logprobs_are_the_rollouts_for_every_budget_and_order(checkpoint, samples, budget):
    model = _policy(checkpoint)
    for ordered in (samples, samples[::-1]):
        with torch.no_grad():
            for group in budget_groups(ordered, budget):
                mb = pack_flat(group)
                assert per_sample(mb, score(model, mb), group) == [s.logprobs for s in group]


def test_stock_packing_differs_where_the_canonical_forward_does_not(checkpoint, samples):
    model, stock = _policy(checkpoint), _policy(checkpoint)
    stock.config._attn_implementation = "sdpa"
    flat, padded = pack_flat(samples), pack(samples)
    with torch.no_grad():
        assert per_sample(flat, score(model, flat), samples) == per_sample(padded, score(model, padded), samples)
        stock_packed = per_sample(flat, score(stock, flat, stock=True), samples)
        stock_alone = [per_sample(pack([s]), score(stock, pack([s]), stock=True), [s])[0] for s in samples]
    assert stock_packed != stock_alone
    worst = max(abs(a - b) for x, y in zip(stock_packed, stock_alone) for a, b in zip(x, y))
    assert worst < 0.5  # rounding, not attention across sequences


def _gradients(checkpoint, mb, checkpointed: bool):
    model = _policy(checkpoint).float()
    patch_model(model)
    if checkpointed:
        checkpoint_activations(model)
    logp = score(model, mb)
    (logp * mb["advantages"].cuda() * mb["loss_mask"].cuda()).sum().backward()
    return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def test_activation_checkpointing_keeps_logprobs_and_gradients(checkpoint, samples):
    """The recomputed forward is the canonical one, so checkpointing changes no log-prob bit. CUDA's
    backward kernels (flash attention's, the embedding's) accumulate with atomics, so two backward
    passes of the same model differ by bf16 ulps here and there even without checkpointing (under
    torch.use_deterministic_algorithms the checkpointed gradient still differed on an H200): the
    gradient with checkpointing must be as close to the plain one as two plain passes are to each other
    (the CPU test, deterministic, proves them bit for bit)."""
    mb = pack_flat(samples)
    logp, plain = _gradients(checkpoint, mb, checkpointed=False)
    reruns = [_gradients(checkpoint, mb, checkpointed=False) for _ in range(2)]
    logp_ckpt, ckpt = _gradients(checkpoint, mb, checkpointed=True)
    assert all(torch.equal(logp, other) for other, _ in reruns) and torch.equal(logp, logp_ckpt)
    norm = torch.linalg.vector_norm(plain)
    noise = max(torch.linalg.vector_norm(g - plain) for _, g in reruns) / norm
    assert torch.linalg.vector_norm(ckpt - plain) / norm <= 3 * noise + 1e-6, (noise.item(),)


@pytest.mark.parametrize("layout", [dict(max_tokens_per_micro_batch=2000),
                                    dict(max_tokens_per_micro_batch=6000, activation_checkpointing=True)])
def test_fsdp2_rank_on_cuda_agrees_with_the_rollouts(checkpoint, samples, layout):
    cfg = TrainerConfig(num_ranks=1, device="cuda", optimizer=OptimizerConfig(lr=1e-5),
                        batching=BatchingConfig(**layout))
    result = train_step_in_process(cfg, _policy(checkpoint).cpu(), samples)
    parts = result["agreement"]
    assert sum(p["tokens"] for p in parts) == sum(LENGTHS)
    assert sum(p["mismatched"] for p in parts) == 0 and max(p["max_abs"] for p in parts) == 0.0
    assert result["peak_memory_bytes"] > 0
