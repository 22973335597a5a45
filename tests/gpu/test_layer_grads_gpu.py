"""GPU: a decoder layer's written-out gradients that run as Triton kernels on a GPU, against torch's ops for the
same formulas: RMSNorm's backward (kernels/triton/norm_grad.py against kernels.backward.rms_norm_grads_torch),
and RoPE's (the forward's kernel with -sin, against kernels.backward.rotary_grad_torch).

Gradients need no fixed bits: x's gradient has the formula's bf16 roundings and may differ by the order of a
row's sums, the weight's by the order of the sum over rows. TRITON_INTERPRET=1 runs the small cases on CPU
(tests/test_trainer_patch.py does); the kernel has no dot, so the interpreter's values are real.
"""
from __future__ import annotations

import pytest
import torch

from kernels.backward import rms_norm_grads_torch
from triton_shared import DEV, INTERPRET, kt, needs_cuda  # noqa: F401 (kt: a fixture)

pytestmark = pytest.mark.gpu


def case(shape, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(*shape, device=DEV, generator=gen) * 2).to(torch.bfloat16)
    w = (1 + torch.randn(shape[-1], device=DEV, generator=gen) / 4).to(torch.bfloat16)
    g = torch.randn(*shape, device=DEV, generator=gen).to(torch.bfloat16)
    return x, w, g


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(7, 64), (33, 100), (3, 5, 128), (1, 1536)])
def test_rms_norm_grads_are_the_formulas(kt, shape):
    x, w, g = case(shape)
    gx, gw = kt.rms_norm_grads(x, w, 1e-6, g, True, True)
    want_x, want_w = rms_norm_grads_torch(x, w, 1e-6, g, True, True)
    assert gx.shape == x.shape and gx.dtype == x.dtype and gw.shape == w.shape and gw.dtype == w.dtype
    assert rel(gx, want_x) < 1e-2 and rel(gw, want_w) < 1e-2
    # controls: another eps, another weight give other gradients
    assert rel(kt.rms_norm_grads(x, w, 1.0, g, True, False)[0], want_x) > 1e-2
    assert rel(kt.rms_norm_grads(x, w.flip(0), 1e-6, g, True, False)[0], want_x) > 1e-2
    # one of the two alone gives the same as both
    assert torch.equal(kt.rms_norm_grads(x, w, 1e-6, g, True, False)[0], gx)
    assert kt.rms_norm_grads(x, w, 1e-6, g, False, True)[0] is None
    assert torch.equal(kt.rms_norm_grads(x, w, 1e-6, g, False, True)[1], gw)


def test_the_residual_gradient_is_added_in_xs_dtype(kt):
    x, w, g = case((9, 96))
    res = torch.randn(9, 96, device=DEV).to(torch.bfloat16)
    gx, _ = kt.rms_norm_grads(x, w, 1e-6, g, True, False)
    summed, _ = kt.rms_norm_grads(x, w, 1e-6, g, True, False, res)
    if INTERPRET:  # the interpreter's casts to bf16 do not round to nearest even: within a rounding
        assert rel(summed, res + gx) < 1e-2 and not torch.equal(summed, gx)
    else:
        assert torch.equal(summed, res + gx)  # autograd's sum of two bf16 gradients


def test_strided_heads_as_q_and_k_norms_see_them(kt):
    """Qwen3's per-head norms take q as a view of the fused projection's output: [tokens, heads, 128] rows
    that are not one stride apart."""
    x, w, g = case((6, 4 * 128 + 64))
    xq = x[:, :512].view(6, 4, 128)
    gq = g[:, :512].reshape(6, 4, 128)
    gx, gw = kt.rms_norm_grads(xq, w[:128], 1e-6, gq, True, True)
    want_x, want_w = rms_norm_grads_torch(xq, w[:128], 1e-6, gq, True, True)
    assert gx.shape == xq.shape and rel(gx, want_x) < 1e-2 and rel(gw, want_w) < 1e-2


def test_bad_shapes_are_refused(kt):
    x, w, g = case((4, 64))
    with pytest.raises(ValueError, match="rms_norm_grads needs"):
        kt.rms_norm_grads(x, w[:32], 1e-6, g, True, True)
    with pytest.raises(ValueError, match="rms_norm_grads needs"):
        kt.rms_norm_grads(x, w, 1e-6, g[:2], True, True)


@needs_cuda
@pytest.mark.parametrize("shape", [(16384, 2560), (16384, 32, 128), (4099, 1536), (2, 8192)])
def test_rms_norm_grads_at_model_shapes(kt, shape):
    x, w, g = case(shape, seed=1)
    gx, gw = kt.rms_norm_grads(x, w, 1e-6, g, True, True)
    want_x, want_w = rms_norm_grads_torch(x, w, 1e-6, g, True, True)
    assert rel(gx, want_x) < 1e-2 and rel(gw, want_w) < 1e-2


@needs_cuda
def test_rope_gradients_through_the_kernel_have_the_formulas_bits(kt):
    """RoPE's gradient is the rotation by -angle: the forward's unfused kernel with -sin gives the bits of the
    fp32 formula, for q and k in one launch and for one tensor; a control with +sin differs."""
    import kernels as K
    from kernels.backward import rotary_grad_torch
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 300, 32, 128, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    k = torch.randn(2, 300, 8, 128, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    angle = torch.randn(2, 300, 64, device="cuda", generator=gen)
    cos, sin = angle.cos(), angle.sin()
    gq = torch.randn(2, 300, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    gk = torch.randn(2, 300, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    got_q, got_k = torch.autograd.grad(K.rotary_qk(q, k, cos, sin), (q, k), (gq, gk))
    assert torch.equal(got_q, rotary_grad_torch(gq, cos, sin, torch.bfloat16))
    assert torch.equal(got_k, rotary_grad_torch(gk, cos, sin, torch.bfloat16))
    (one,) = torch.autograd.grad(K.rotary(q, cos, sin), (q,), gq)
    assert torch.equal(one, got_q)
    assert not torch.equal(got_q, kt.rotary(gq, cos, sin)), "the control: the forward rotation is not its transpose"
