"""GPU: the lm head's backward pieces (kernels.backward.logits_grad, accumulate_product) against torch's ops.

Gradients need no fixed bits: the kernel and the GEMM's fused accumulation must agree with the float32
formula to bf16 rounding. TRITON_INTERPRET=1 runs the small cases on CPU (tests/test_trainer_patch.py
does); the kernel has no dot, so the interpreter's values are real.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

from triton_shared import DEV, INTERPRET, kt, needs_cuda  # noqa: F401,E402 (kt: a fixture)


def formula(z, g, tokens, t, vocab_limit=None):
    """(onehot - softmax(z / t)) * g / t in float32 (ids at or past vocab_limit: probability 0)."""
    zf = z.float() / t
    if vocab_limit is not None:
        zf[:, vocab_limit:] = float("-inf")
    onehot = F.one_hot(tokens, z.shape[1]).float()
    return (onehot - torch.softmax(zf, dim=-1)) * g.float()[:, None] / t


def case(rows, vocab, seed=0, scale=4.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    z = (torch.randn(rows, vocab, device=DEV, generator=gen) * scale).to(torch.bfloat16)
    g = torch.randn(rows, device=DEV, generator=gen)
    tokens = torch.randint(0, vocab, (rows,), device=DEV, generator=gen)
    return z, g, tokens


def close_to_bf16(got, want):
    """Within a bf16 rounding of the float32 formula, entry by entry."""
    return torch.allclose(got.float(), want, rtol=1e-2, atol=1e-6 + 1e-2 * want.abs().max().item() / 64)


@pytest.mark.parametrize("rows,vocab,t,limit", [(5, 100, 1.0, None), (3, 4096, 0.7, None), (4, 5000, 1.3, 4200),
                                                (2, 9000, 1.0, 9000), (1, 17, 2.0, 16)])
def test_logits_grad_kernel_is_the_formula(kt, rows, vocab, t, limit):
    z, g, tokens = case(rows, vocab)
    if limit is not None:
        tokens = tokens % limit
    want = formula(z, g, tokens, t, limit)
    got = kt.logits_grad_(z.clone(), g, tokens, t, limit)
    assert got.dtype == torch.bfloat16 and close_to_bf16(got, want)
    if limit is not None and limit < vocab:
        assert torch.count_nonzero(got[:, limit:]) == 0, "ids past the limit get no gradient"
        assert not close_to_bf16(kt.logits_grad_(z.clone(), g, tokens, t, None), want), "the limit matters"
    assert not close_to_bf16(kt.logits_grad_(z.clone(), g, tokens, t * 1.5, limit), want), "t matters"
    # each row's gradient sums to ~0 over the allowed ids: softmax sums to 1, the one-hot to 1
    assert got.float().sum(-1).abs().max() < 1e-2 * g.abs().max() / t + 1e-3


def test_logits_grad_writes_in_place_and_refuses_bad_shapes(kt):
    z, g, tokens = case(3, 300)
    assert kt.logits_grad_(z, g, tokens, 1.0).data_ptr() == z.data_ptr()
    with pytest.raises(ValueError, match="one gradient and one token per row"):
        kt.logits_grad_(z, g[:2], tokens, 1.0)
    with pytest.raises(ValueError, match="contiguous rows"):
        kt.logits_grad_(z.T, g, tokens, 1.0)


@needs_cuda
@pytest.mark.parametrize("rows,vocab", [(2048, 151936), (777, 151936), (2048, 128256)])
def test_logits_grad_at_real_vocabularies(kt, rows, vocab):
    z, g, tokens = case(rows, vocab, scale=6.0)
    got = kt.logits_grad_(z.clone(), g, tokens, 1.0)
    assert close_to_bf16(got, formula(z, g, tokens, 1.0))


@needs_cuda
def test_accumulate_product_adds_in_place_in_float32():
    from kernels.backward import accumulate_product
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(4096, 512, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(512, 2560, device="cuda", generator=gen).to(torch.bfloat16)
    acc = torch.randn(4096, 2560, device="cuda", generator=gen)
    start, ptr = acc.clone(), acc.data_ptr()
    accumulate_product(acc, a, b)
    want = start + a.float() @ b.float()
    assert acc.data_ptr() == ptr and acc.dtype == torch.float32
    assert (acc - want).norm() / want.norm() < 1e-5  # float32 accumulation, not a bf16 product's rounding
    rounded = start + (a @ b).float()
    assert (rounded - want).norm() / want.norm() > 1e-4, "control: a bf16 product rounds"


@needs_cuda
def test_head_backward_matches_autograd_of_the_formula():
    """kernels.head_token_logprobs' gradients on a GPU (kernel + fused accumulation) against autograd through
    log_softmax(h @ w.T / t)[token] in float32, with the vocabulary limit."""
    import kernels as K
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, hidden, vocab, t, limit = 3000, 256, 151936, 0.9, 151000
    h = (torch.randn(rows, hidden, device="cuda", generator=gen) / 4).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) / 4).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, limit, (rows,), device="cuda", generator=gen)
    g = torch.randn(rows, device="cuda", generator=gen)
    logp, _ = K.head_token_logprobs(h, w, t, tokens, chunk_rows=1024, vocab_limit=limit)
    got = torch.autograd.grad(logp, (h, w), g)
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    z = (hf @ wf.T) / t
    z[:, limit:] = float("-inf")
    ref = torch.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0]
    want = torch.autograd.grad(ref, (hf, wf), g)
    for a, e in zip(got, want):
        assert a.dtype == torch.bfloat16 and (a.float() - e).norm() / e.norm() < 2e-2
