"""trainer_patch public API: gradients, bad input, unsupported models, and the `kernels` name clash."""
import subprocess
import sys

import pytest
import torch

import trainer_patch
from conftest import attention_fp32
from rollout_service.tiny_models import tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_backward_gives_finite_gradients_close_to_unpatched(arch):
    ids = torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0

    def grads(model, patched):
        model.train()
        if patched:
            logp = trainer_patch.token_logprobs(model, ids, mask)
        else:
            logits = model(input_ids=ids).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
        logp.sum().backward()
        return {n: p.grad.float() for n, p in model.named_parameters()}

    # fp32 master weights, as a trainer keeps them; the canonical forward computes in bf16
    ref = grads(tiny_model(arch, seed=3, dtype=torch.float32), patched=False)
    got = grads(trainer_patch.patch_model(tiny_model(arch, seed=3, dtype=torch.float32)), patched=True)
    for name, g in got.items():
        assert torch.isfinite(g).all(), name
        rel = (g - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)
        assert rel < 0.1, f"{name}: relative gradient error {rel:.3f}"


@pytest.mark.parametrize("padded", [False, True])
def test_op_gradients_are_the_ordinary_ones(padded):
    import kernels as K
    gen = torch.Generator().manual_seed(1)
    # linear: F.linear's backward on the same bf16 inputs (bias included)
    x, w, b = (torch.randn(*s, generator=gen).to(torch.bfloat16).requires_grad_() for s in ((2, 5, 64), (48, 64), (48,)))
    g = torch.randn(2, 5, 48, generator=gen)
    want = torch.autograd.grad(torch.nn.functional.linear(x, w, b), (x, w, b), g.to(torch.bfloat16))
    got = torch.autograd.grad(K.matmul(x, w, b, row_parallel=True, out_dtype=torch.float32), (x, w, b), g)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.allclose(a.float(), e.float(), rtol=2e-2, atol=2e-2)
    # the MLP's silu(gate) * up and the residual add: autograd through the same ops in bf16
    gate, up = (torch.randn(3, 40, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(2))
    g = torch.randn(3, 40, generator=gen).to(torch.bfloat16)
    for op, ref in ((K.silu_mul, lambda a, b: torch.nn.functional.silu(a) * b), (K.add, torch.add)):
        got = torch.autograd.grad(op(gate, up), (gate, up), g)
        want = torch.autograd.grad(ref(gate, up), (gate, up), g)
        assert all(torch.equal(a, e) for a, e in zip(got, want))
    # rms_norm and RoPE have their backward written out: autograd through the reference formula gives
    # the same bits (RoPE) or agrees to bf16 rounding (rms_norm)
    from kernels import reference as R
    from kernels.backward import rms_norm_ref
    x, nw = torch.randn(3, 7, 64, generator=gen).to(torch.bfloat16), (1 + torch.randn(64, generator=gen) / 4)
    x, nw = x.requires_grad_(), nw.to(torch.bfloat16).requires_grad_()
    g = torch.randn(3, 7, 64, generator=gen).to(torch.bfloat16)
    got = torch.autograd.grad(K.rms_norm(x, nw, 1e-6), (x, nw), g)
    want = torch.autograd.grad(rms_norm_ref(x, nw, 1e-6), (x, nw), g)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and e.abs().sum() > 0
        assert (a.float() - e.float()).norm() / e.float().norm() < 1e-2
    xr = torch.randn(2, 5, 3, 16, generator=gen).to(torch.bfloat16).requires_grad_()
    angle = torch.randn(2, 5, 8, generator=gen)
    g = torch.randn(2, 5, 3, 16, generator=gen).to(torch.bfloat16)
    got = torch.autograd.grad(K.rotary(xr, angle.cos(), angle.sin()), xr, g)[0]
    want = torch.autograd.grad(R.rotary(xr, angle.cos(), angle.sin()), xr, g)[0]
    assert torch.equal(got, want) and not torch.equal(got, g), "RoPE's gradient is the rotation's transpose"
    # attention: close to fp32 autograd; with padding rows (negative positions) still finite
    q, k, v = (torch.randn(2, 12, h, 16, generator=gen).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    pos = torch.arange(12).repeat(2, 1)
    if padded:
        pos[1, 9:] = -1
    g = torch.randn(2, 12, 4, 16, generator=gen)
    g[pos < 0] = 0  # nothing downstream uses a padding row
    got = torch.autograd.grad(K.attention(q, k, v, pos), (q, k, v), g.to(torch.bfloat16))
    want = torch.autograd.grad(attention_fp32(q, k, v, pos, 0.25), (q, k, v), g)
    for a, e in zip(got, want):
        assert torch.isfinite(a).all()
        assert (a.float() - e).norm() / e.norm() < 2e-2


def test_fused_nodes_give_the_gradients_of_the_ops_one_by_one():
    """add + rms_norm and RoPE on q and k as one autograd node each (the GPU's one-launch forms) give the
    bits of the ops one by one, forward and backward (here over the reference ops; tests/gpu: Triton)."""
    import kernels as K
    from kernels import reference as R
    from kernels.backward import add_rms_norm_with_grad, rotary_qk_with_grad
    gen = torch.Generator().manual_seed(2)
    bf = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    a, b, w = bf(3, 7, 64).requires_grad_(), bf(3, 7, 64).requires_grad_(), (1 + bf(64) / 4).requires_grad_()
    grads = bf(3, 7, 64), bf(3, 7, 64)

    def apart(a, b, w):
        s = K.add(a, b)
        return s, K.rms_norm(s, w, 1e-6)

    def one_launch(a_, b_, w_):
        s = R.add(a_, b_)
        return s, R.rms_norm(s, w_, 1e-6)
    fused = add_rms_norm_with_grad(one_launch, a, b, w, 1e-6)
    got = torch.autograd.grad(fused, (a, b, w), grads)
    want = torch.autograd.grad(apart(a, b, w), (a, b, w), grads)
    assert all(torch.equal(x, y) for x, y in zip(fused, apart(a, b, w)))
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert not torch.equal(got[0], grads[0]), "s's gradient includes the norm's"
    q, k = bf(2, 5, 4, 16).requires_grad_(), bf(2, 5, 2, 16).requires_grad_()
    angle = torch.randn(2, 5, 8, generator=gen)
    cos, sin = angle.cos(), angle.sin()
    grads = bf(2, 5, 4, 16), bf(2, 5, 2, 16)
    fused = rotary_qk_with_grad(lambda q_, k_, c, s: (R.rotary(q_, c, s), R.rotary(k_, c, s)), q, k, cos, sin)
    got = torch.autograd.grad(fused, (q, k), grads)
    want = torch.autograd.grad((K.rotary(q, cos, sin), K.rotary(k, cos, sin)), (q, k), grads)
    assert all(torch.equal(x, y) for x, y in zip(got, want)) and not torch.equal(got[0], grads[0])


def test_whole_sequence_check_runs_once_per_positions_tensor(monkeypatch):
    """The attention backward's choice of kernel asks the host once per positions tensor (a forward's
    layers share one), and asks again when the tensor changes."""
    from kernels import backward as B
    pos = torch.arange(6).repeat(2, 1)
    assert B.whole_sequences(pos, 6) and not B.whole_sequences(pos, 7)
    calls = []
    real_arange = torch.arange
    monkeypatch.setattr(B.torch, "arange", lambda *a, **k: calls.append(1) or real_arange(*a, **k))
    assert B.whole_sequences(pos, 7) is False and B.whole_sequences(pos, 7) is False and not calls
    pos[1, 4:] = -1  # padding: a new version of the same tensor
    assert B.whole_sequences(pos, 7) is False and B.whole_sequences(pos, 6) is False and len(calls) == 1


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_head_token_logprobs_have_the_logits_paths_bits_in_any_chunking(temperature):
    """Scoring rows through the lm head a chunk at a time gives each row the bits of the full-logits path
    (whatever the chunk size), and the ordinary gradient; bf16 logits (the stock path) give other bits."""
    import kernels as K
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(96, 64, generator=gen) / 8).to(torch.bfloat16)
    tokens = torch.randint(0, 96, (37,), generator=gen)
    logits = K.matmul(hidden, weight, out_dtype=torch.float32)
    want = K.token_logprobs(logits, temperature, tokens)
    t = K.logprob_temperature(temperature)
    lsm = torch.log_softmax(K.scale_logits(logits, t), dim=-1)
    want_entropy = -(lsm.exp() * lsm).sum(-1)
    g = torch.randn(37, generator=gen)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    stock = torch.log_softmax(torch.nn.functional.linear(h, w).float() / t, -1).gather(-1, tokens[:, None])[:, 0]
    want_grads = torch.autograd.grad(stock, (h, w), g)
    assert not torch.equal(stock.detach(), want), "the control: bf16 logits are not the canonical path"
    for chunk_rows in (1, 5, 37, 100):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        got, entropy = K.head_token_logprobs(h, w, temperature, tokens, entropy=True, chunk_rows=chunk_rows)
        assert torch.equal(got.detach(), want), chunk_rows
        assert torch.allclose(entropy, want_entropy, rtol=1e-5, atol=1e-6) and not entropy.requires_grad
        grads = torch.autograd.grad(got, (h, w), g)
        for a, e in zip(grads, want_grads):
            assert a.dtype == e.dtype and (a.float() - e.float()).norm() / e.float().norm() < 2e-2


def test_the_backward_kernels_under_the_interpreter():
    """The GPU's backward kernels (kernels/triton/head_grad.py, norm_grad.py) against torch's formulas, on CPU
    through Triton's interpreter (the kernels have no dot, so their values are real there)."""
    import os
    from pathlib import Path
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    files = ["tests/gpu/test_head_grad_gpu.py", "tests/gpu/test_layer_grads_gpu.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


def test_scored_forward_equals_the_logits_forward_where_scored():
    """model(ids, zerokl_score=ScoreTokens(positions, T)): the logits path's log-probs at the scored positions,
    0 elsewhere; a wrong positions mask is refused."""
    import kernels as K
    model = trainer_patch.patch_model(tiny_model("qwen2", seed=7))
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(2))
    positions = torch.rand(3, 19, generator=torch.Generator().manual_seed(3)) < 0.5
    with torch.no_grad():
        full = K.token_logprobs(model(input_ids=ids).logits[:, :-1], 0.8, ids[:, 1:])
        out = model(input_ids=ids, zerokl_score=trainer_patch.ScoreTokens(positions, 0.8, entropy=True))
    assert torch.equal(out.log_probs[positions], full[positions])
    assert (out.log_probs[~positions] == 0).all() and (out.entropy[~positions] == 0).all()
    assert (out.entropy[positions] > 0).all()
    with pytest.raises(ValueError, match="positions must be bool"):
        model(input_ids=ids, zerokl_score=trainer_patch.ScoreTokens(positions[:, 1:], 0.8))


def test_unsupported_model_raises_clear_error():
    import transformers
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(TypeError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        trainer_patch.patch_model(gpt2)
    with pytest.raises(TypeError):
        trainer_patch.patch_model(torch.nn.Linear(2, 2))


def test_bad_inputs_raise_clear_errors():
    model = trainer_patch.patch_model(tiny_model("qwen2"))
    ids = torch.randint(0, 96, (2, 10))
    for bad in (-1.0, float("nan"), float("inf"), True, "0.7"):
        with pytest.raises(ValueError, match="temperature"):
            trainer_patch.token_logprobs(model, ids, temperature=bad)
    # greedy rollouts (T = 0) report log-probs at T = 1: the one rule of kernels.logprobs
    greedy = trainer_patch.token_logprobs(model, ids, temperature=0.0)
    assert torch.equal(greedy, trainer_patch.token_logprobs(model, ids, temperature=1.0))
    assert not torch.equal(greedy, trainer_patch.token_logprobs(model, ids, temperature=0.7))
    with pytest.raises(TypeError, match="integer"):
        trainer_patch.token_logprobs(model, ids.float())
    with pytest.raises(ValueError, match="outside"):
        trainer_patch.token_logprobs(model, ids + 200)
    with pytest.raises(ValueError, match="non-empty"):
        trainer_patch.token_logprobs(model, torch.zeros(0, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        trainer_patch.token_logprobs(model, ids[0])
    with pytest.raises(ValueError, match="at least 2"):
        trainer_patch.token_logprobs(model, ids[:, :1])
    with pytest.raises(ValueError, match="right-padded"):
        trainer_patch.token_logprobs(model, ids, torch.tensor([[0, 1] * 5, [1] * 10]))
    with pytest.raises(TypeError):
        trainer_patch.token_logprobs(model, ids.tolist())


def test_bad_op_inputs_raise():
    import kernels as K
    x = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(TypeError):
        K.matmul(x.float(), torch.randn(3, 8).to(torch.bfloat16))
    with pytest.raises(ValueError):
        K.matmul(x, torch.randn(3, 9).to(torch.bfloat16))
    with pytest.raises(ValueError):
        K.matmul(x[:0], torch.randn(3, 8).to(torch.bfloat16))
    with pytest.raises(TypeError):
        K.log_softmax(x)
    with pytest.raises(ValueError):
        K.rms_norm(x, torch.ones(7, dtype=torch.bfloat16), 1e-6)


def test_patch_is_idempotent_and_returns_model():
    model = tiny_model("llama")
    assert trainer_patch.patch_model(model) is model
    assert trainer_patch.patch_model(model) is model
    assert trainer_patch.is_patched(model)


def test_our_kernels_package_does_not_confuse_transformers(tmp_path):
    """transformers probes for the hub `kernels` package; ours must not be mistaken for it."""
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    code = f"""
import kernels, transformers
from transformers.utils import import_utils
assert kernels.__file__ and 'canonical' in kernels.__doc__.lower()
assert not import_utils.is_kernels_available(), 'transformers thinks hub kernels are installed'
m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
import torch
out = m(input_ids=torch.tensor([[1, 2, 3]])).logits
assert out.shape == (1, 3, 96)
print('ok')
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
