"""The CPU properties of the canonical forward, the engine audit and zero KL, on CUDA."""
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import kernels as K  # noqa: E402
import trainer_patch  # noqa: E402
from conftest import assert_bitwise_equal  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service import Engine, SamplingParams  # noqa: E402
from rollout_service.audit import run_audit  # noqa: E402

CUDA = torch.device("cuda")


def _model(arch="qwen2", **kw):
    # wider than the CPU tiny model so that GPU GEMM shapes are realistic enough to show cuBLAS effects
    return tiny_model(arch, seed=1, hidden_size=256, intermediate_size=768, num_heads=8, num_kv_heads=2,
                      vocab_size=1024, **kw).to(CUDA)


def test_triton_backend_is_used_on_cuda():
    x = torch.randn(4, 64, device=CUDA).to(torch.bfloat16)
    assert K.backend_for(x).__name__ == "kernels.triton"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logprobs_alone_batched_and_incremental_are_identical(arch):
    model = trainer_patch.patch_model(_model(arch))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1024, (n,), generator=g) for n in (70, 9, 130, 33, 1 + 64)]
    alone = [trainer_patch.token_logprobs(model, s[None].to(CUDA)) for s in seqs]
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    batch = trainer_patch.token_logprobs(model, ids.to(CUDA), mask.to(CUDA))
    for i, s in enumerate(seqs):
        assert_bitwise_equal(batch[i, :len(s) - 1], alone[i][0], f"seq {i}")
    # whole sequence == rollout engine (chunked prefill + decode on paged KV)
    engine = Engine(model, device="cuda", window=8, max_prefill_tokens=24)
    prompt = seqs[0][:30].tolist()
    r = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    train = trainer_patch.token_logprobs(model, torch.tensor([prompt + r.token_ids], device=CUDA))[0, 29:]
    assert torch.equal(train.cpu(), torch.tensor(r.logprobs))


def test_negative_control_unpatched_model_differs_across_batch_sizes():
    """One decoder layer with Llama-3.1-8B dimensions: cuBLAS changes a sequence's log-probs with the
    batch size (measurements.md: down 14336x4096 varies from M=128), the canonical forward does not."""
    model = tiny_model("llama", seed=1, hidden_size=4096, intermediate_size=14336, num_layers=1, num_heads=32,
                       num_kv_heads=8, vocab_size=2048, max_positions=256).to(CUDA)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (32, 64), generator=g).to(CUDA)
    with torch.no_grad():
        alone = torch.log_softmax(model(input_ids=ids[:1]).logits.float(), -1)
        differing = [b for b in (2, 8, 32)
                     if not torch.equal(torch.log_softmax(model(input_ids=ids[:b]).logits.float(), -1)[:1], alone)]
    print("unpatched log-probs of sequence 0 differ at batch sizes", differing)
    assert differing, "cuBLAS / SDPA happened to be batch-invariant for these shapes"
    patched = trainer_patch.patch_model(model)
    canon = trainer_patch.token_logprobs(patched, ids[:1])
    for b in (2, 8, 32):
        assert_bitwise_equal(trainer_patch.token_logprobs(patched, ids[:b])[:1], canon, f"batch {b}")


def test_engine_audit_on_cuda():
    model = _model("qwen2")
    make = lambda **kw: Engine(model, device="cuda", copy_model=False, **kw)  # noqa: E731
    results = run_audit(make, 1024, tests=("single", "mixed"), modes=("verified", "invariant", "off"), max_tokens=8)
    for r in results:
        print(f"{r.test:7s} {r.mode:9s} {r.sampling:16s} distinct={r.max_distinct}")
    assert all(r.deterministic for r in results if r.mode != "off")


@pytest.mark.parametrize("temperature,width", [(0.0, 8), (0.7, 8), (0.7, 4), (0.7, 1)])
def test_zero_kl_and_verified_equals_invariant_on_cuda(temperature, width, tree_width):
    tree_width(width)  # the trainer and the engine below share this process's tree width
    model = _model("qwen3")
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(5, 80))] for _ in range(16)]
    engine = Engine(model, device="cuda", window=16, group=8, verified_decode="dvr")
    out = {m: engine.generate(prompts, [SamplingParams(max_tokens=32, temperature=temperature, top_p=0.9, seed=i,
                                                        determinism=m) for i in range(16)])
           for m in ("verified", "invariant")}
    t_eff = temperature or 1.0
    for i, p in enumerate(prompts):
        v = out["verified"][i]
        assert (v.token_ids, v.logprobs) == (out["invariant"][i].token_ids, out["invariant"][i].logprobs)
        train = trainer_patch.token_logprobs(model, torch.tensor([p + v.token_ids], device=CUDA),
                                             temperature=t_eff)[0, len(p) - 1:]
        assert torch.equal(train.cpu(), torch.tensor(v.logprobs))


def test_sampler_is_batch_invariant_on_cuda():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 32000, generator=g) * 3).to(CUDA)
    args = lambda n: (torch.full((n,), 0.7, device=CUDA), torch.full((n,), 50, device=CUDA),  # noqa: E731
                      torch.full((n,), 0.9, device=CUDA), torch.arange(n, device=CUDA) * 31,
                      torch.arange(n, device=CUDA) + 100)
    full = K.sample(logits, *args(64))
    for i in (0, 17, 63):
        one = K.sample(logits[i:i + 1], *[a[i:i + 1] for a in args(64)])
        assert int(one) == int(full[i])
    # the noise is the same bits as on CPU (integer hash + exact-math log)
    assert torch.equal(K.gumbel_noise(torch.tensor([5]), torch.tensor([9]), 100),
                       K.gumbel_noise(torch.tensor([5], device=CUDA), torch.tensor([9], device=CUDA), 100).cpu())


def test_fused_gpu_sampler_equals_cpu_rule():
    """The fused Triton sampler (hash, exact log, scale, mask, first argmax in one pass) picks what the
    CPU reference picks on the same logits, and its noise is bit-identical to the CPU noise."""
    g = torch.Generator().manual_seed(1)
    n, vocab = 48, 151936
    logits = torch.randn(n, vocab, generator=g) * 2
    logits[5, 100:110] = 50.0  # ties: the lowest id wins
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3] * (n // 4))
    seeds = torch.tensor([(2 ** 40 + 7 * i) * (1 if i % 3 else 3) for i in range(n)], dtype=torch.int64)
    positions = torch.arange(n) * 97 + 5
    for top_k, top_p in [(0, 1.0), (40, 0.9)]:
        k = torch.full((n,), top_k)
        p = torch.full((n,), top_p)
        cpu = K.sample(logits, temps, k, p, seeds, positions)
        gpu = K.sample(logits.to(CUDA), temps, k, p, seeds, positions)
        assert torch.equal(cpu, gpu.cpu()), (top_k, top_p)
    noise_cpu = K.gumbel_noise(seeds, positions, vocab)
    noise_gpu = K.gumbel_noise(seeds.to(CUDA), positions.to(CUDA), vocab).cpu()
    assert torch.equal(noise_cpu, noise_gpu)
    # the check can fail: one bit of the seed changes most of the noise
    assert (K.gumbel_noise(seeds.to(CUDA) ^ 1, positions.to(CUDA), vocab).cpu() != noise_cpu).float().mean() > 0.9
