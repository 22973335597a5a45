"""CUDA-graph replay of decode steps / verify windows, and the fast path's split-KV decode kernel."""
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import kernels as K  # noqa: E402
import trainer_patch  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service import Engine, SamplingParams  # noqa: E402
from rollout_service.engine.cuda_graphs import GraphedModelRunner  # noqa: E402
from rollout_service.engine.fast_path.decode_attention import decode_attention  # noqa: E402

CUDA = torch.device("cuda")


def _model(arch="qwen2"):
    return tiny_model(arch, seed=1, hidden_size=256, intermediate_size=768, num_heads=8, num_kv_heads=2,
                      vocab_size=1024).to(CUDA)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def _outputs(engine, prompts, mode, first_seed=0):
    params = [SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=first_seed + i, determinism=mode)
              for i in range(len(prompts))]
    return [(r.token_ids, r.logprobs) for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("mode", ["verified", "invariant"])
def test_graph_replay_equals_eager_engine(mode):
    model = _model()
    prompts = _prompts(13)
    graphed = Engine(model, device="cuda", window=8, group=4)
    eager = Engine(model, device="cuda", window=8, group=4, cuda_graphs=False)
    assert isinstance(graphed.canonical_runner, GraphedModelRunner)
    assert isinstance(graphed.fast_path.runner, GraphedModelRunner)
    got = _outputs(graphed, prompts, mode)
    assert got == _outputs(eager, prompts, mode)
    assert graphed.canonical_runner._graphs, "no graph was replayed"
    # and a request alone (batch bucket 1, other shapes) gives the same rollout as inside the batch
    assert _outputs(graphed, prompts[5:6], mode, first_seed=5) == got[5:6]


def test_graphed_verified_rollouts_have_zero_kl_against_trainer():
    model = _model("llama")
    engine = Engine(model, device="cuda", window=8, group=4)
    prompts = _prompts(6, seed=3)
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=i) for i in range(len(prompts))]
    patched = trainer_patch.patch_model(model)
    for prompt, r in zip(prompts, engine.generate(prompts, params)):
        seq = torch.tensor([prompt + r.token_ids], device=CUDA)
        train = trainer_patch.token_logprobs(patched, seq, temperature=1.0)[0, len(prompt) - 1:]
        assert torch.equal(train.cpu(), torch.tensor(r.logprobs))


def test_split_kv_decode_attention_matches_sdpa():
    torch.manual_seed(0)
    b, hq, hkv, d, bs, blocks = 5, 8, 2, 64, 16, 200
    k_pool = torch.randn(blocks, bs, hkv, d, device=CUDA).to(torch.bfloat16)
    v_pool = torch.randn(blocks, bs, hkv, d, device=CUDA).to(torch.bfloat16)
    q = torch.randn(b, 1, hq, d, device=CUDA).to(torch.bfloat16)
    lengths = [1, 17, 300, 1000, 0]  # the last row is padding (position -1)
    perm = torch.randperm(blocks).tolist()
    table = torch.zeros(b, 64, dtype=torch.int32)
    for i, n in enumerate(lengths):
        need = -(-n // bs)
        table[i, :need] = torch.tensor(perm[:need])
        perm = perm[need:] + perm[:need]
    positions = torch.tensor([[n - 1] for n in lengths], device=CUDA)
    out = decode_attention(q, k_pool, v_pool, positions, table.to(CUDA), d ** -0.5)
    for i, n in enumerate(lengths):
        if n == 0:
            assert bool((out[i] == 0).all())
            continue
        idx = table[i, :-(-n // bs)].long().to(CUDA)
        k = k_pool[idx].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, 1)
        v = v_pool[idx].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, 1)
        att = torch.softmax(torch.einsum("hd,nhd->hn", q[i, 0].float(), k) * d ** -0.5, dim=-1)
        ref = torch.einsum("hn,nhd->hd", att, v)
        err = (out[i, 0].float() - ref).norm() / ref.norm()
        assert err < 1e-2, (i, n, float(err))
    # canonical attention agrees closely too (different rounding, same function)
    canon = K.attention(q, k_pool, v_pool, positions, block_table=table.to(CUDA), scale=d ** -0.5)
    assert (canon[:4].float() - out[:4].float()).abs().max() < 0.05
