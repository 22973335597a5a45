"""kernels.lora_add, a LoRA term's scale, add and select in one op, and kernels.lora_expand_add, its expand
and that epilogue in one op: on CPU the same bits and gradients as the ops they replace; the Triton kernels under
Triton's interpreter against the same ops (the GPU tests run them on CUDA, tests/gpu/test_triton_kernels.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels as K

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs(m=12, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(m, 2 * n, generator=g) * 3).to(torch.bfloat16)[:, :n]
    product = (torch.randn(m, n, generator=g) * 0.05).to(torch.bfloat16)
    base[0, :4], product[0, :4] = -0.0, 0.0
    return base, product, torch.arange(m) % 3 != 0


@pytest.mark.parametrize("masked", [False, True])
def test_the_same_bits_and_gradients_as_mul_add_and_select(masked):
    base, product, mask = _inputs()
    mask = mask if masked else None
    grads = []
    for fused in (True, False):
        b, p = base.clone().requires_grad_(), product.clone().requires_grad_()
        if fused:
            y = K.lora_add(b, p, 1.7, mask)
        else:
            added = K.add(b, torch.mul(p, 1.7))
            y = added if mask is None else torch.where(mask.unsqueeze(-1), added, b)
        (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        grads.append((y.detach(), b.grad, p.grad))
    (y1, gb1, gp1), (y2, gb2, gp2) = grads
    assert torch.equal(y1.view(torch.int16), y2.view(torch.int16))
    assert torch.equal(gb1, gb2) and torch.equal(gp1, gp2)
    # the comparison can fail: -0.0 left out keeps its sign only when selected
    assert torch.equal(y1[0, :4].view(torch.int16), base[0, :4].view(torch.int16)) == masked


def test_bad_inputs_are_refused():
    base, product, mask = _inputs()
    with pytest.raises(ValueError, match="equal shapes"):
        K.lora_add(base, product[:, :8], 2.0)
    with pytest.raises(ValueError, match="mask must be bool"):
        K.lora_add(base, product, 2.0, mask.float())
    with pytest.raises(ValueError, match="mask must be bool"):
        K.lora_add(base, product, 2.0, mask[:4])
    with pytest.raises(TypeError, match="bfloat16"):
        K.lora_add(base.float(), product, 2.0)


@pytest.mark.parametrize("masked", [False, True])
def test_the_expand_and_epilogue_give_the_bits_of_matmul_then_lora_add(masked):
    """lora_expand_add without a gradient (rollouts: one launch on GPU) and with one (training: the two
    differentiable ops) give the bits of matmul then lora_add, and the gradient reaches h and B."""
    base, _, mask = _inputs()
    mask = mask if masked else None
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(base.shape[0], 40, generator=g).to(torch.bfloat16)
    h, b = wide[:, 24:32], (torch.randn(base.shape[1], 8, generator=g) * 0.05).to(torch.bfloat16)
    want = K.lora_add(base, K.matmul(h, b), 1.7, mask)
    with torch.no_grad():
        assert torch.equal(K.lora_expand_add(base, h, b, 1.7, mask).view(torch.int16), want.view(torch.int16))
    hg, bg = h.clone().requires_grad_(), b.clone().requires_grad_()
    y = K.lora_expand_add(base, hg, bg, 1.7, mask)
    assert torch.equal(y.detach().view(torch.int16), want.view(torch.int16)) and y.requires_grad
    y.float().sum().backward()
    assert hg.grad is not None and bg.grad is not None and bg.grad.abs().sum() > 0
    # the comparison can fail: without the product's bf16 rounding the bits differ
    unrounded = K.add(base, (h.float() @ b.float().T * 1.7).to(torch.bfloat16))
    assert not torch.equal(want if mask is None else want[mask], unrounded if mask is None else unrounded[mask])


@pytest.mark.parametrize("grad", [False, True])
def test_a_groups_terms_side_by_side_give_each_terms_bits(grad):
    """widths: q/k/v's terms in one op (member j: its columns of base and rows of B, its block of h) give the
    bits of one op per member, with and without a gradient."""
    g = torch.Generator().manual_seed(6)
    widths, r = (24, 8, 8), 4
    base = (torch.randn(10, 50, generator=g) * 3).to(torch.bfloat16)[:, :40]
    h = torch.randn(10, 3 * r + 5, generator=g).to(torch.bfloat16)[:, 5:]
    b = (torch.randn(40, r, generator=g) * 0.05).to(torch.bfloat16)
    mask = torch.arange(10) % 4 != 0
    each = torch.cat([K.lora_expand_add(base[:, c:c + w], h[:, j * r:(j + 1) * r], b[c:c + w], 1.7, mask)
                      for j, (c, w) in enumerate(zip((0, 24, 32), widths))], dim=-1)
    if grad:
        b = b.clone().requires_grad_()
    with torch.set_grad_enabled(grad):
        together = K.lora_expand_add(base, h, b, 1.7, mask, widths=widths)
    assert torch.equal(together.detach().view(torch.int16), each.view(torch.int16))
    # the comparison can fail: every member reading h's first block gives other bits
    assert not torch.equal(K.lora_expand_add(base, h[:, :r].repeat(1, 3), b.detach(), 1.7, mask, widths=widths), each)


def test_bad_expand_inputs_are_refused():
    base, _, mask = _inputs()
    h, b = torch.zeros(base.shape[0], 8, dtype=torch.bfloat16), torch.zeros(base.shape[1], 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="lora_expand_add takes"):
        K.lora_expand_add(base, h, b[:, :4], 2.0)
    with pytest.raises(ValueError, match="lora_expand_add takes"):
        K.lora_expand_add(base, h[:4], b, 2.0)
    with pytest.raises(ValueError, match="lora_expand_add takes"):
        K.lora_expand_add(base, h, b, 2.0, widths=(8, 8))  # widths that do not sum to N
    with pytest.raises(ValueError, match="lora_expand_add takes"):
        K.lora_expand_add(base, h, b, 2.0, widths=(base.shape[1] - 8, 8))  # one block of h for two members
    with pytest.raises(ValueError, match="mask must be bool"):
        K.lora_expand_add(base, h, b, 2.0, mask.float())
    with pytest.raises(TypeError, match="bfloat16"):
        K.lora_expand_add(base, h.float(), b, 2.0)


def test_the_triton_kernel_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          "tests/gpu/test_triton_kernels.py", "-k", "lora_add or lora_expand_add"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
