"""The lm head's backward per chunk of rows (kernels.backward._HeadTokenLogprobs), step by step: the logits
recomputed, their gradient (torch's float32 ops against the in-place Triton kernel), the two GEMMs, and the
weight gradient's float32 accumulation (a bf16 product then its float32 sum, against one GEMM adding into the
accumulator)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels.triton as kt
from bench.kernel_timing.timing import bench_ms
from kernels.backward import logits_grad_torch

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
