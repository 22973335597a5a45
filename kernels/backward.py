"""Canonical forward, ordinary backward.

Only the forward numbers must match the rollout engine; gradients come from the standard formula of
each op (evaluated at the same inputs), computed the way the unpatched bf16 model computes them:
linear layers by bf16 GEMMs (cuBLAS on CUDA), attention by scaled_dot_product_attention's backward
(flash on CUDA), the elementwise ops by autograd through their plain-torch formulas.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.nn.functional as F


class _CanonicalForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, canonical: Callable, reference: Callable, *inputs):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return canonical(*inputs)

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad_out.to(out.dtype), allow_unused=True))
        return (None, None, *[next(grads) if t.requires_grad else None for t in inputs])


def with_reference_grad(canonical: Callable, reference: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    """canonical(*inputs), differentiable through reference(*inputs) when grad is needed."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _CanonicalForward.apply(canonical, reference, *inputs)
    return canonical(*inputs)


class _CanonicalLinear(torch.autograd.Function):
    """Canonical x @ weight.T (+ bias); F.linear's backward in the inputs' dtype (no forward recompute)."""

    @staticmethod
    def forward(ctx, canonical: Callable, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return canonical(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.to(x.dtype)
        g2 = g.reshape(-1, g.shape[-1])
        grad_x = g @ weight if ctx.needs_input_grad[1] else None
        grad_w = g2.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[2] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, grad_x, grad_w, grad_b


def linear_with_grad(canonical: Callable, x, weight, bias=None):
    """canonical(x, weight, bias), differentiable by the ordinary linear backward when grad is needed."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _CanonicalLinear.apply(canonical, x, weight, bias)
    return canonical(x, weight, bias)


def rms_norm_ref(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y.to(torch.bfloat16).float()).to(torch.bfloat16)


def silu_mul_ref(gate, up):
    """The unpatched MLP's act_fn(gate) * up, in the inputs' dtype."""
    return F.silu(gate) * up


# Rule: an op that runs once or more per decoder layer has its backward written out (below) rather
# than recomputed through autograd (_CanonicalForward): a nested autograd pass costs about a
# millisecond of host time per call, and a 28-layer model makes 140 such calls per backward, which
# left the GPU idle for a third of a training step. Each written backward is the formula autograd
# derives from the reference, evaluated in the same dtypes (silu_mul's by the same aten ops, so the
# same bits; the others agree to rounding, which tests bound).

def _gpu_kernels(t: torch.Tensor):
    """kernels.triton where t is on a GPU and Triton is there (the backward's own kernels live there too),
    else None: the backward then runs torch's ops for the same formula."""
    if not t.is_cuda:
        return None
    from .backend import triton_backend
    return triton_backend()


def _rms_norm_grads(x, weight, eps: float, grad_out, want_x: bool, want_w: bool, residual_grad=None):
    """(grad x, grad weight) of rms_norm_ref at x (None where not wanted); residual_grad: a gradient of x's from
    elsewhere, added to grad x in x's dtype (autograd's sum of the two). On a GPU one Triton launch
    (kernels/triton/norm_grad.py), else torch's ops."""
    backend = _gpu_kernels(x)
    if backend is not None:
        return backend.rms_norm_grads(x, weight, eps, grad_out, want_x, want_w, residual_grad)
    grad_x, grad_w = rms_norm_grads_torch(x, weight, eps, grad_out, want_x, want_w)
    if grad_x is not None and residual_grad is not None:
        grad_x = residual_grad.to(x.dtype) + grad_x
    return grad_x, grad_w


def rms_norm_grads_torch(x, weight, eps: float, grad_out, want_x: bool, want_w: bool):
    """_rms_norm_grads by torch's ops, over float32 copies of x and the gradient."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    g = grad_out.float()
    grad_w = None
    if want_w:
        normed = (xf * r).to(torch.bfloat16).float()
        grad_w = (g * normed).reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
    grad_x = None
    if want_x:
        # the rounding of x * r to bf16 passes the gradient through in bf16, as autograd's does
        gn = (g * weight.float()).to(torch.bfloat16).float()
        dot = (gn * xf).sum(-1, keepdim=True)
        grad_x = (gn * r - xf * (r.pow(3) * dot / xf.shape[-1])).to(x.dtype)
    return grad_x, grad_w


class _CanonicalRmsNorm(torch.autograd.Function):
    """Canonical rms_norm; the backward of rms_norm_ref: y = w * bf16(x * r), r = rsqrt(mean(x^2) + eps)."""

    @staticmethod
    def forward(ctx, canonical: Callable, x, weight, eps: float):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return canonical(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = _rms_norm_grads(x, weight, ctx.eps, grad_out, ctx.needs_input_grad[1],
                                         ctx.needs_input_grad[2])
        return None, grad_x, grad_w, None


class _CanonicalAddRmsNorm(torch.autograd.Function):
    """Canonical (s, rms_norm(s)) with s = a + b, from one launch; the backward of add then rms_norm_ref:
    s's gradient is the one it gets directly plus the norm's, in s's dtype (autograd's sum of the two)."""

    @staticmethod
    def forward(ctx, canonical: Callable, a, b, weight, eps: float):
        s, y = canonical(a, b, weight)
        ctx.save_for_backward(s, weight)
        ctx.eps, ctx.dtypes = eps, (a.dtype, b.dtype)
        return s, y

    @staticmethod
    def backward(ctx, grad_s, grad_y):
        s, weight = ctx.saved_tensors
        want_s = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        total, grad_w = _rms_norm_grads(s, weight, ctx.eps, grad_y, want_s, ctx.needs_input_grad[3], grad_s)
        return (None, None if total is None else total.to(ctx.dtypes[0]),
                None if total is None else total.to(ctx.dtypes[1]), grad_w, None)


def add_rms_norm_with_grad(canonical: Callable, a, b, weight, eps: float):
    """canonical(a, b, weight) -> (s, y), differentiable as add then rms_norm_ref when grad is needed."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or weight.requires_grad):
        return _CanonicalAddRmsNorm.apply(canonical, a, b, weight, eps)
    return canonical(a, b, weight)


def rms_norm_with_grad(canonical: Callable, x, weight, eps: float):
    """canonical(x, weight), differentiable as rms_norm_ref(x, weight, eps) when grad is needed."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _CanonicalRmsNorm.apply(canonical, x, weight, eps)
    return canonical(x, weight)


class _CanonicalSiluMul(torch.autograd.Function):
    """Canonical silu_mul; silu_mul_ref's backward by the aten ops autograd runs for it."""

    @staticmethod
    def forward(ctx, canonical: Callable, gate, up):
        ctx.save_for_backward(gate, up)
        return canonical(gate, up)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        g = grad_out.to(gate.dtype)
        grad_gate = torch.ops.aten.silu_backward(g * up, gate) if ctx.needs_input_grad[1] else None
        grad_up = g * F.silu(gate) if ctx.needs_input_grad[2] else None
        return None, grad_gate, grad_up


def silu_mul_with_grad(canonical: Callable, gate, up):
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _CanonicalSiluMul.apply(canonical, gate, up)
    return canonical(gate, up)


def rotary_grad_torch(grad_out, cos, sin, dtype):
    """The rotate-half rotation's transpose applied to grad_out, in fp32 (the formula's dtype)."""
    g1, g2 = grad_out.float().chunk(2, dim=-1)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.cat([g1 * c + g2 * s, g2 * c - g1 * s], dim=-1).to(dtype)


def _rotary_grads_on_gpu(grads, cos, sin, dtypes):
    """The rotation's transpose is the rotation by -angle: on a GPU, bf16 gradients go through the forward's
    Triton kernel with -sin, one launch for q and k. Its products and sums are unfused and in the formula's
    order, so the bits are rotary_grad_torch's. None where that does not apply (CPU, other dtypes)."""
    backend = _gpu_kernels(grads[0])
    if backend is None or any(d != torch.bfloat16 for d in (*dtypes, *(g.dtype for g in grads))):
        return None
    if len(grads) == 1:
        return (backend.rotary(grads[0], cos, -sin),)
    return backend.rotary_qk(grads[0], grads[1], cos, -sin)


class _CanonicalRotary(torch.autograd.Function):
    """Canonical rotate-half RoPE; the backward of its fp32 formula (a rotation: its transpose)."""

    @staticmethod
    def forward(ctx, canonical: Callable, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return canonical(x, cos, sin)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        fast = _rotary_grads_on_gpu((grad_out,), cos, sin, (ctx.dtype,))
        grad_x = fast[0] if fast is not None else rotary_grad_torch(grad_out, cos, sin, ctx.dtype)
        return None, grad_x, None, None


def _check_tables(cos, sin):
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rotary: cos and sin take no gradient")


def rotary_with_grad(canonical: Callable, x, cos, sin):
    """canonical(x, cos, sin), differentiable in x (cos and sin are tables: they take no gradient)."""
    _check_tables(cos, sin)
    if torch.is_grad_enabled() and x.requires_grad:
        return _CanonicalRotary.apply(canonical, x, cos, sin)
    return canonical(x, cos, sin)


class _CanonicalRotaryQK(torch.autograd.Function):
    """Canonical (rotary(q), rotary(k)) from one launch; each one's backward that of _CanonicalRotary."""

    @staticmethod
    def forward(ctx, canonical: Callable, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = q.dtype, k.dtype
        return canonical(q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        fast = _rotary_grads_on_gpu((grad_q, grad_k), cos, sin, ctx.dtypes)
        if fast is None:
            fast = (rotary_grad_torch(grad_q, cos, sin, ctx.dtypes[0]),
                    rotary_grad_torch(grad_k, cos, sin, ctx.dtypes[1]))
        return None, fast[0], fast[1], None, None


def rotary_qk_with_grad(canonical: Callable, q, k, cos, sin):
    """canonical(q, k, cos, sin) -> (rotary(q), rotary(k)), differentiable in q and k."""
    _check_tables(cos, sin)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _CanonicalRotaryQK.apply(canonical, q, k, cos, sin)
    return canonical(q, k, cos, sin)


class _CanonicalAdd(torch.autograd.Function):
    """Canonical a + b; the gradient passes to both unchanged (nothing to recompute)."""

    @staticmethod
    def forward(ctx, canonical: Callable, a, b):
        ctx.dtypes = a.dtype, b.dtype
        return canonical(a, b)

    @staticmethod
    def backward(ctx, grad_out):
        return None, grad_out.to(ctx.dtypes[0]), grad_out.to(ctx.dtypes[1])


def add_with_grad(canonical: Callable, a, b):
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _CanonicalAdd.apply(canonical, a, b)
    return canonical(a, b)


class _CanonicalLoraAdd(torch.autograd.Function):
    """Canonical lora_add(base, product, scale, mask): the gradient passes to base unchanged, and to product
    times scale on the rows of mask (zero elsewhere), as through the mul, add and select it fuses."""

    @staticmethod
    def forward(ctx, canonical: Callable, base, product, scale: float, mask):
        ctx.dtypes, ctx.scale = (base.dtype, product.dtype), scale
        ctx.save_for_backward(mask)
        return canonical(base, product, scale, mask)

    @staticmethod
    def backward(ctx, grad_out):
        (mask,) = ctx.saved_tensors
        grad_product = None
        if ctx.needs_input_grad[2]:
            grad_product = torch.mul(grad_out, ctx.scale)
            if mask is not None:
                grad_product = torch.where(mask.unsqueeze(-1), grad_product, torch.zeros_like(grad_product))
            grad_product = grad_product.to(ctx.dtypes[1])
        return None, grad_out.to(ctx.dtypes[0]), grad_product, None, None


def lora_add_with_grad(canonical: Callable, base, product, scale: float, mask):
    if torch.is_grad_enabled() and (base.requires_grad or product.requires_grad):
        return _CanonicalLoraAdd.apply(canonical, base, product, scale, mask)
    return canonical(base, product, scale, mask)


# id(positions) -> (a weak reference to it, its version, keys, answer): whole_sequences' answers, each
# dropped with its tensor (a WeakKeyDictionary would compare tensors with ==)
_WHOLE_SEQUENCES: dict[int, tuple] = {}


def whole_sequences(positions: torch.Tensor, keys: int) -> bool:
    """Whether every row of positions [B, T] is 0 .. T-1 and there are T keys: the causal kernels' case.
    One host sync per positions tensor: a forward's layers share theirs, so the check runs once a forward
    (a packed row's sequences each have theirs, marked by mark_whole_sequences: no sync at all)."""
    memo = _WHOLE_SEQUENCES.get(id(positions))
    if memo is not None and memo[0]() is positions and memo[1] == positions._version and memo[2] == keys:
        return memo[3]
    t_q = positions.shape[1]
    answer = t_q == keys and bool((positions == torch.arange(t_q, device=positions.device)).all())
    _remember(positions, keys, answer)
    return answer


def mark_whole_sequences(positions: torch.Tensor) -> torch.Tensor:
    """Record that positions [B, T] is 0 .. T-1 in every row, which its caller has checked; returns it."""
    _remember(positions, positions.shape[1], True)
    return positions


def _remember(positions: torch.Tensor, keys: int, answer: bool) -> None:
    key = id(positions)
    if key not in _WHOLE_SEQUENCES:
        weakref.finalize(positions, _WHOLE_SEQUENCES.pop, key, None)
    _WHOLE_SEQUENCES[key] = (weakref.ref(positions), positions._version, keys, answer)


def attention_ref(q, k, v, positions, scale, from_zero: bool):
    """Causal GQA attention over contiguous KV (training shapes) by scaled_dot_product_attention, for
    its backward. q [B, T, Hq, D]; query (b, t) sees keys 0..positions[b, t]. from_zero: the answer of
    whole_sequences(positions, T_k), which the forward has asked."""
    groups = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(groups, dim=2),
                                              v.repeat_interleave(groups, dim=2)))
    if from_zero:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:  # padding rows (negative positions) see key 0 only: no empty softmax (their gradient is zero)
        key_pos = torch.arange(k.shape[1], device=q.device)
        visible = (key_pos[None, None, :] <= positions[:, :, None].clamp_min(0))[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible, scale=scale)
    return out.transpose(1, 2)


def _flash_backward_ok(q: torch.Tensor) -> bool:
    """Whether PyTorch's flash-attention kernels take q's shape here (CUDA, sm80+, bf16, head dim <= 256)."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and torch.backends.cuda.flash_sdp_enabled() and torch.cuda.get_device_capability(q.device) >= (8, 0))


def _flash_attention_grads(q, k, v, grad_out, scale: float):
    """(dq, dk, dv) of causal attention over whole sequences by PyTorch's flash kernels: its forward again
    for the softmax statistics, then its backward, as two aten calls and no autograd graph (a nested
    autograd pass costs about a millisecond of host time per layer). k and v keep their Hkv heads: the
    flash kernels group query heads themselves (SDPA's enable_gqa path)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        qt, kt, vt, 0.0, True, False, scale=scale)
    g = grad_out.to(q.dtype).transpose(1, 2)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        g if g.stride(-1) == 1 else g.contiguous(), qt, kt, vt, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True,
        seed, offset, scale=scale)
    return tuple(t.transpose(1, 2) for t in grads)


class _CanonicalAttention(torch.autograd.Function):
    """Canonical causal attention over contiguous KV; attention_ref's backward. Whole sequences on a GPU
    with flash kernels take _flash_attention_grads; the rest a nested autograd pass through attention_ref."""

    @staticmethod
    def forward(ctx, canonical: Callable, q, k, v, positions, scale: float):
        ctx.save_for_backward(q, k, v, positions)
        ctx.scale = scale
        ctx.from_zero = whole_sequences(positions, k.shape[1])
        return canonical(q, k, v)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, positions = ctx.saved_tensors
        if ctx.from_zero and _flash_backward_ok(q):
            grads = _flash_attention_grads(q, k, v, grad_out, ctx.scale)
        else:
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                out = attention_ref(*inputs, positions, ctx.scale, ctx.from_zero)
            grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
        return (None, *(g if want else None for g, want in zip(grads, ctx.needs_input_grad[1:4])), None, None)


def attention_with_grad(canonical: Callable, q, k, v, positions, scale: float):
    """canonical(q, k, v), differentiable as attention_ref when grad is needed."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _CanonicalAttention.apply(canonical, q, k, v, positions, scale)
    return canonical(q, k, v)


def _score_chunks(score_chunk: Callable, hidden, tokens, chunk_rows: int, entropy: bool):
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        logp, ent = score_chunk(hidden[start:start + chunk_rows], tokens[start:start + chunk_rows], entropy)
        logps.append(logp)
        entropies.append(ent)
    return torch.cat(logps), (torch.cat(entropies) if entropy else None)


class _HeadTokenLogprobs(torch.autograd.Function):
    """Canonical log_softmax(hidden @ weight.T / t)[token] per row, a chunk of rows at a time; the ordinary
    backward of that formula, each chunk's logits recomputed by a bf16 GEMM as the unpatched model computes
    them. Neither pass holds more than one chunk's [rows, V] logits."""

    @staticmethod
    def forward(ctx, score_chunk: Callable, hidden, weight, tokens, t: float, chunk_rows: int, entropy: bool,
                vocab_limit: int | None = None):
        logp, ent = _score_chunks(score_chunk, hidden, tokens, chunk_rows, entropy)
        ctx.save_for_backward(hidden, weight, tokens)
        ctx.t, ctx.chunk_rows, ctx.vocab_limit = t, chunk_rows, vocab_limit
        if ent is None:
            ent = hidden.new_empty(0, dtype=torch.float32)
        ctx.mark_non_differentiable(ent)  # a metric: no gradient flows through it
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, tokens = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            h = hidden[rows]
            grad_z = logits_grad(F.linear(h, weight), grad_logp[rows], tokens[rows], ctx.t, ctx.vocab_limit)
            if want_hidden:
                grad_hidden[rows] = grad_z @ weight
            if want_weight:
                accumulate_product(grad_weight, grad_z.T, h)
        return (None, grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None,
                None, None)


def logits_grad(z, g, tokens, t: float, vocab_limit: int | None = None):
    """(onehot(tokens) - softmax(z / t)) * g[:, None] / t in z's dtype, for bf16 logits z [rows, V] (ids at or
    past vocab_limit have probability 0 and get no gradient): the Triton kernel over z in place on a GPU,
    else torch's ops in float32."""
    backend = _gpu_kernels(z)
    if backend is not None:
        return backend.logits_grad_(z, g, tokens, t, vocab_limit)
    return logits_grad_torch(z, g, tokens, t, vocab_limit)


def logits_grad_torch(z, g, tokens, t: float, vocab_limit: int | None = None):
    """logits_grad by torch's ops in float32: six passes over [rows, V]."""
    zf = z.float()
    if vocab_limit is not None:
        zf[:, vocab_limit:] = float("-inf")
    gf = g.float()
    grad_z = torch.softmax(zf / t, dim=-1).mul_(-gf[:, None])
    grad_z[torch.arange(z.shape[0], device=z.device), tokens] += gf
    return grad_z.div_(t).to(z.dtype)


def accumulate_product(acc, a, b) -> None:
    """acc += a @ b for a float32 acc and bf16 a, b: on a GPU one cuBLAS GEMM that adds into acc in its
    epilogue (torch.addmm's out_dtype), else the bf16 product then its float32 sum."""
    if acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += (a @ b).float()


def head_logprobs_with_grad(score_chunk: Callable, hidden, weight, tokens, t: float, chunk_rows: int,
                            entropy: bool, vocab_limit: int | None = None):
    """score_chunk(rows of hidden, their tokens, entropy) -> (log-probs, entropies or None), over chunks of
    chunk_rows rows; differentiable in hidden and weight by _HeadTokenLogprobs when grad is needed
    (vocab_limit: the ids score_chunk forbids, given no gradient)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        logp, ent = _HeadTokenLogprobs.apply(score_chunk, hidden, weight, tokens, t, chunk_rows, entropy,
                                             vocab_limit)
        return logp, (ent if entropy else None)
    return _score_chunks(score_chunk, hidden, tokens, chunk_rows, entropy)
