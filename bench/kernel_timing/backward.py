"""The trainer's backward pieces that have a GPU kernel of their own, against torch's ops for the same formula.

The lm head's backward per chunk of rows (kernels.backward._HeadTokenLogprobs), step by step: the logits
recomputed, their gradient (torch's float32 ops against the in-place Triton kernel), the two GEMMs, and the
weight gradient's float32 accumulation (a bf16 product then its float32 sum, against one GEMM adding into the
accumulator). RMSNorm's backward (kernels.backward._rms_norm_grads) at a micro-batch of 16,384 tokens: the
layer's norms and Qwen3's per-head q and k norms; and RoPE's on q and k (the forward's kernel with -sin)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels.triton as kt
from bench.kernel_timing.timing import bench_ms
from kernels.backward import logits_grad_torch, rms_norm_grads_torch, rotary_grad_torch

SHAPES = {"qwen3-4b": (2560, 151936), "qwen1.5b": (1536, 151936)}  # hidden, vocab


def run_head_backward(rep: int, rows: int = 2048) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for model, (hidden, vocab) in SHAPES.items():
        h = (torch.randn(rows, hidden, generator=gen, device="cuda") / 4).to(torch.bfloat16)
        w = (torch.randn(vocab, hidden, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        g = torch.randn(rows, generator=gen, device="cuda")
        tokens = torch.randint(0, vocab, (rows,), generator=gen, device="cuda")
        z = F.linear(h, w)
        grad_z = logits_grad_torch(z, g, tokens, 1.0)
        acc = torch.zeros(vocab, hidden, device="cuda")

        def accumulate_apart():
            acc.add_((grad_z.T @ h).float())

        row = {"model": model, "rows": rows, "hidden": hidden, "vocab": vocab,
               "recompute_logits_ms": bench_ms(lambda: F.linear(h, w), rep),
               "logits_grad_torch_ms": bench_ms(lambda: logits_grad_torch(z, g, tokens, 1.0), rep),
               "logits_grad_kernel_ms": bench_ms(lambda: kt.logits_grad_(z.clone(), g, tokens, 1.0), rep),
               "logits_clone_ms": bench_ms(lambda: z.clone(), rep),  # the kernel's timing includes one clone
               "grad_hidden_ms": bench_ms(lambda: grad_z @ w, rep),
               "weight_grad_apart_ms": bench_ms(accumulate_apart, rep),
               "weight_grad_fused_ms": bench_ms(
                   lambda: torch.addmm(acc, grad_z.T, h, out_dtype=torch.float32, out=acc), rep)}
        row["logits_grad_kernel_ms"] -= row["logits_clone_ms"]
        common = row["recompute_logits_ms"] + row["grad_hidden_ms"]
        row["chunk_before_ms"] = common + row["logits_grad_torch_ms"] + row["weight_grad_apart_ms"]
        row["chunk_after_ms"] = common + row["logits_grad_kernel_ms"] + row["weight_grad_fused_ms"]
        row["chunk_before_over_after"] = row["chunk_before_ms"] / row["chunk_after_ms"]
        out.append(row)
    return out


# (name, rows, width): a 16,384-token micro-batch of Qwen3-4B (hidden 2560; 32 query and 8 KV heads of 128)
NORMS = [("layer norm", 16384, 2560), ("q norm", 16384 * 32, 128), ("k norm", 16384 * 8, 128)]


def run_norm_backward(rep: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for name, rows, width in NORMS:
        x = torch.randn(rows, width, generator=gen, device="cuda").to(torch.bfloat16)
        w = (1 + torch.randn(width, generator=gen, device="cuda") / 4).to(torch.bfloat16)
        g = torch.randn(rows, width, generator=gen, device="cuda").to(torch.bfloat16)
        row = {"norm": name, "rows": rows, "width": width,
               "torch_ms": bench_ms(lambda: rms_norm_grads_torch(x, w, 1e-6, g, True, True), rep),
               "kernel_ms": bench_ms(lambda: kt.rms_norm_grads(x, w, 1e-6, g, True, True), rep)}
        row["torch_over_kernel"] = row["torch_ms"] / row["kernel_ms"]
        out.append(row)
    return out


def run_rope_backward(rep: int, tokens: int = 16384, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> dict:
    """RoPE's backward on a micro-batch's q and k: torch's fp32 formula per tensor against one launch of the
    forward's kernel with -sin (the same bits)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    gq = torch.randn(1, tokens, q_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    gk = torch.randn(1, tokens, kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    angle = torch.randn(1, tokens, head_dim // 2, generator=gen, device="cuda")
    cos, sin = angle.cos(), angle.sin()
    row = {"tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
           "torch_ms": bench_ms(lambda: (rotary_grad_torch(gq, cos, sin, torch.bfloat16),
                                         rotary_grad_torch(gk, cos, sin, torch.bfloat16)), rep),
           "kernel_ms": bench_ms(lambda: kt.rotary_qk(gq, gk, cos, -sin), rep)}
    row["torch_over_kernel"] = row["torch_ms"] / row["kernel_ms"]
    return row
