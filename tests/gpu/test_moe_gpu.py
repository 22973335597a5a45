"""GPU: the grouped expert kernels (kernels/triton/moe.py) compute every row exactly as the canonical
matmul does, whatever the other rows of the batch, so the MoE block through them equals the loop over
experts (kernels/moe.py) bit for bit; they need no host sync (a CUDA graph can hold the layer); stock
transformers decoding with a KV cache does not reproduce its own training forward (the negative control).

Run with `pytest -m gpu tests/gpu/test_moe_gpu.py` on a machine with CUDA and triton.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import kernels as K  # noqa: E402
from conftest import assert_bitwise_equal  # noqa: E402
from kernels.forward import CANONICAL_OPS  # noqa: E402
from kernels.moe import group_by_expert, moe_forward, moe_spec  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402

ktm = pytest.importorskip("kernels.triton").moe
CUDA = torch.device("cuda")
BF = torch.bfloat16
# Qwen3-30B-A3B's sparse layer
A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
LOADS = [0, 1, 7, 64, 300]  # rows per expert


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=CUDA) * scale).to(BF)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF)


def grouped(x, weight, expert_of_row: torch.Tensor, silu: bool = False, config=None) -> torch.Tensor:
    """Rows of x (in x's order) through the grouped kernel, row i on expert expert_of_row[i]."""
    groups = group_by_expert(expert_of_row.reshape(-1, 1), weight.shape[0])
    out = ktm.grouped_matmul(x, weight, groups.offsets, src=groups.token, silu=silu, config=config)
    return torch.empty_like(out).index_copy_(0, groups.token, out)


def plain(x, weight, silu: bool = False) -> torch.Tensor:
    """The plain canonical path of the loop: kernels.matmul (+ kernels.silu_mul)."""
    y = K.matmul(x, weight)
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = K.silu_mul(gate.contiguous(), up.contiguous())
    return y


@pytest.fixture(scope="module")
def a3b_block():
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = transformers.Qwen3MoeConfig(**A3B)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block.to(CUDA, BF).eval(), moe_spec(cfg)


# ------------------------------------------------------------------------ (a) rows = kernels.matmul


@pytest.mark.parametrize("k_dim,n_dim,silu", [
    (HIDDEN, 2 * INTER, True),  # gate_up + silu_mul
    (INTER, HIDDEN, False),  # down
    (200, 320, False),  # K not a multiple of 64 (masked tail), N not a multiple of the tile
    (200, 2 * 150, True),
])
def test_grouped_rows_equal_the_plain_matmul(k_dim, n_dim, silu):
    """Experts serving 0, 1, 7, 64 and 300 rows, rows shuffled: each row's bits are those of
    kernels.matmul(rows of that expert, weight[e]) (+ kernels.silu_mul), for every launch config."""
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(LOADS)])
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(k_dim))].to(CUDA)
    x = randn(len(ids), k_dim, seed=1)
    w = randn(len(LOADS), n_dim, k_dim, seed=2, scale=0.05)
    configs = [None]
    if k_dim == HIDDEN:  # every entry of the launch table, and a few more
        configs += sorted({cfg for row in ktm._TABLE for cfg in row[1:]}, key=str)
        configs += [ktm.GroupedConfig(16, 64, 4, 3), ktm.GroupedConfig(64, 64, 4, 3)]
    for config in configs:
        out = grouped(x, w, ids, silu, config)
        for e, n in enumerate(LOADS):
            rows = torch.nonzero(ids == e).flatten()
            assert len(rows) == n
            if n:
                assert_bitwise_equal(out[rows], plain(x[rows], w[e], silu), f"expert {e} ({n} rows), config {config}")


# ------------------------------------------------------------------- (b) independent of the batch


def test_a_tokens_expert_output_does_not_depend_on_the_batch():
    """Token 0 on expert 5: alone, among 511 other tokens all on expert 5, and in a batch of 4096 tokens
    x 8 experts (another tile shape): the same gate_up + silu and down bits."""
    gate_up = randn(EXPERTS, 2 * INTER, HIDDEN, seed=3, scale=0.02)
    down = randn(EXPERTS, HIDDEN, INTER, seed=4, scale=0.02)
    x = randn(4096, HIDDEN, seed=5)
    crowd = torch.randint(0, EXPERTS, (4096 * TOP_K,), generator=torch.Generator().manual_seed(6)).to(CUDA)
    crowd[0] = 5
    compositions = {"alone": (x[:1], torch.tensor([5], device=CUDA)),
                    "512 on expert 5": (x[:512], torch.full((512,), 5, device=CUDA)),
                    "4096 x 8 random": (x.repeat_interleave(TOP_K, 0), crowd)}
    results = {}
    for name, (rows, ids) in compositions.items():
        h = grouped(rows, gate_up, ids, silu=True)
        results[name] = (h[0], grouped(h, down, ids)[0])
    want = results["alone"]
    assert_bitwise_equal(want[0], plain(x[:1], gate_up[5], silu=True)[0], "alone vs kernels.matmul")
    for name, got in results.items():
        assert_bitwise_equal(got[0], want[0], f"gate_up+silu, {name} vs alone")
        assert_bitwise_equal(got[1], want[1], f"down, {name} vs alone")


# ---------------------------------------------------------------------- (c) grouped == loop, block


def _grouped_equals_loop(block, spec, x):
    with torch.no_grad():
        loop = moe_forward(block, x, spec, CANONICAL_OPS, bf16, grouped=False)
        fused = moe_forward(block, x, spec, CANONICAL_OPS, bf16)  # the default on CUDA: grouped
    assert_bitwise_equal(fused, loop, f"grouped vs loop, x {tuple(x.shape)}")
    return loop


def test_moe_block_grouped_equals_loop_tiny_qwen3_moe():
    model = tiny_model("qwen3_moe", seed=1).to(CUDA)
    spec = moe_spec(model.config)
    for layer in model.model.layers:
        for shape in ((1, 1), (3, 37), (2, 300)):
            _grouped_equals_loop(layer.mlp, spec, randn(*shape, model.config.hidden_size, seed=sum(shape)))


@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_moe_block_grouped_equals_loop_30b_a3b(a3b_block, tokens):
    block, spec = a3b_block
    x = randn(1, tokens, HIDDEN, seed=tokens)
    out = _grouped_equals_loop(block, spec, x)
    with torch.no_grad():  # and a token's output does not depend on the rest of the batch
        alone = moe_forward(block, x[:, :1], spec, CANONICAL_OPS, bf16)
    assert_bitwise_equal(alone[0, 0], out[0, 0], "token 0 alone vs in the batch")


# ---------------------------------------------------------------------- (d) the negative control
# On an H100 (torch 2.11, cuBLAS of CUDA 13) the stock per-expert GEMMs, torch's grouped_mm and
# transformers' sparse block were each batch-invariant at these shapes: a token alone and in batches of
# 7 .. 4096 rows got the same bits. Where a stock MoE model does lose the trainer's numbers is the
# rollout itself: decoding with a KV cache computes each token's router input differently from the
# training forward over the whole sequence, so the logits (and at times the routing) differ.


def test_negative_control_stock_decoding_differs_from_the_training_forward():
    """Stock transformers Qwen3-MoE (bf16, its default attention and experts): the logits of tokens
    decoded one at a time with a KV cache differ in some bit from the training forward's logits of the
    same sequence. The canonical forward (trainer_patch) makes them equal: the engine tests.
    Run with torch's default SDPA backends, as in a plain training process: importing vLLM (other
    GPU test modules do, at collection) switches cuDNN attention off process-wide, and with flash
    attention alone these tiny shapes decode to the training forward's bits."""
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        differing = _stock_decoding_mismatches()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
    assert differing > 0, "stock decoding equalled the training forward bit for bit: this control shows nothing"


def _stock_decoding_mismatches() -> int:
    """Tokens whose logits differ between decoding with a KV cache and the training forward."""
    model = tiny_model("qwen3_moe", seed=3, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2,
                       num_layers=4, vocab_size=512, max_positions=1024).to(CUDA).eval()
    ids = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(4)).to(CUDA)
    prompt = 32
    with torch.no_grad():
        train = model(ids).logits[:, prompt - 1:-1].float()
        out = model(ids[:, :prompt], use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(prompt, ids.shape[1] - 1):
            out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits[:, -1])
        rollout = torch.stack(steps, dim=1).float()
    return (rollout != train).any(-1).sum().item()


# --------------------------------------------------------------------------- (e) gradients


def test_gradients_flow_through_the_grouped_path():
    """With grads enabled the forward keeps the loop's bits; every input and weight gets a finite,
    nonzero gradient close to the loop path's (both are ordinary bf16 backward formulas)."""
    model = tiny_model("qwen3_moe", seed=2, dtype=torch.float32).to(CUDA)
    block, spec = model.model.layers[0].mlp, moe_spec(model.config)
    x0 = torch.randn(2, 50, model.config.hidden_size, device=CUDA).to(BF)
    grads, outs = {}, {}
    for grouped_path in (True, False):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = moe_forward(block, x, spec, CANONICAL_OPS, bf16, grouped=grouped_path)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device=CUDA)).sum().backward()
        outs[grouped_path] = out.detach()
        grads[grouped_path] = {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}
    assert_bitwise_equal(outs[True], outs[False], "grouped vs loop forward with grads")
    assert set(grads[True]) == {"x", "gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    for name, g in grads[True].items():
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
        ref = grads[False][name].float()
        assert (g.float() - ref).norm() <= 2e-2 * ref.norm(), f"{name}: far from the loop path's gradient"


# ---------------------------------------------------------------- no host sync: a CUDA graph


def test_grouped_layer_has_no_host_sync_and_replays_in_a_cuda_graph(a3b_block):
    block, spec = a3b_block
    x = randn(1, 256, HIDDEN, seed=14)
    run = lambda: moe_forward(block, x, spec, CANONICAL_OPS, bf16)  # noqa: E731
    with torch.no_grad():
        want = run()  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a synchronizing op inside the layer raises
        try:
            again = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_bitwise_equal(again, want, "second call")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        x.copy_(randn(1, 256, HIDDEN, seed=15))
        graph.replay()
        assert_bitwise_equal(captured, moe_forward(block, x, spec, CANONICAL_OPS, bf16, grouped=False),
                             "graph replay on new inputs vs the loop")


# ------------------------------------------------------------------------ (f) the native engine's graphs


@pytest.mark.parametrize("mode", ["invariant", "verified"])
def test_engine_replays_moe_graphs_and_equals_the_trainer(tmp_path, mode):
    """The native engine captures its canonical MoE forwards in CUDA graphs (grouped experts, no host
    sync); rollouts from graphs, in a batch with chunked prefill, equal eager ones alone and the
    trainer's log-probs (from_pretrained bf16, patched) bit for bit; requests that record their
    routing (run eagerly) get the trainer's routing token for token."""
    import random

    import trainer_patch
    from transformers import AutoModelForCausalLM

    from rollout_service import Engine, SamplingParams
    from rollout_service.engine.cuda_graphs import GraphedModelRunner

    tiny_model("qwen3_moe", seed=3, dtype=torch.float32, num_layers=3).save_pretrained(tmp_path)
    trainer = trainer_patch.patch_model(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=BF).to(CUDA))
    rng = random.Random(6)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(3, 60))] for _ in range(10)]
    params = [SamplingParams(max_tokens=16, temperature=[0.0, 0.8][i % 2], seed=50 + i, determinism=mode,
                             return_routed_experts=i >= 7) for i in range(len(prompts))]
    engine = Engine(str(tmp_path), device="cuda", window=4, group=4, max_prefill_tokens=24, max_num_seqs=8)
    assert isinstance(engine.canonical_runner, GraphedModelRunner)
    assert engine.capture_graphs() > 0
    batch = engine.generate(prompts, params)
    eager = Engine(str(tmp_path), device="cuda", window=4, group=4, cuda_graphs=False)
    alone = [eager.generate([p], [q])[0] for p, q in zip(prompts[:3], params[:3])]
    assert [(r.token_ids, r.logprobs) for r in alone] == [(r.token_ids, r.logprobs) for r in batch[:3]]
    for prompt, p, r in zip(prompts, params, batch):
        assert r.ok and len(r.token_ids) == 16, r.error
        routing = []
        want = trainer_patch.token_logprobs(trainer, torch.tensor([prompt + r.token_ids], device=CUDA),
                                            temperature=p.temperature, routing=routing)
        assert r.logprobs == want[0, -16:].tolist()
        if p.return_routed_experts:  # the rows that scored the generated tokens: [token][layer][k]
            assert r.routed_experts == torch.stack(routing, dim=2)[0, len(prompt) - 1:-1].tolist()
        else:
            assert r.routed_experts is None
