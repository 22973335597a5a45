"""Benchmark the Triton canonical kernels against cuBLAS / SDPA / torch on one GPU; prints JSON.

    python bench/kernels.py [--out FILE] [--quick] [--sweep]

matmul: Llama-3.1-8B shapes x M in {1 .. 8192}; canonical TFLOP/s (launch table), cuBLAS
(torch.matmul) TFLOP/s and their ratio. o and down are row-parallel in the canonical forward, so they
are measured with the 8-segment tree too ("segments": 8). --sweep also times a grid of launch
configurations per (shape, M) and reports the best (used to write the launch table in
kernels/triton/matmul.py). attention: prefill 4k and decode batch 64 x 4k context vs
scaled_dot_product_attention; with --sweep, decode steps over tiles and split sizes, and prefill steps
(32 prompts of 512 tokens) over tiles. decode (--only decode): the speed tables' decode steps against vLLM's
FA3, in both split schedules over launch tiles. lora (--only lora): a decode step's LoRA ops per layer at
Qwen2.5-1.5B shapes, r = 16, against cuBLAS (bench/kernel_timing/lora.py). backward (--only backward): the lm
head's, RMSNorm's and RoPE's backward, torch's ops against the trainer's kernels (bench/kernel_timing/backward.py).
rms_norm and log_softmax vs torch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import emit


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer M values and shorter timing")
    ap.add_argument("--sweep", action="store_true", help="time a grid of launch configs per (shape, M)")
    ap.add_argument("--only", choices=["matmul", "attention", "decode", "norms", "lora", "backward"], action="append")
    ap.add_argument("--shapes", help="matmul shapes to run, e.g. o/8,down/8 (name/segments)")
    ap.add_argument("--model", default="llama8b", choices=["llama8b", "qwen1.5b"], help="matmul shapes")
    ap.add_argument("--ms", help="matmul M values, e.g. 512,2048,8192")
    args = ap.parse_args()
    # the kernels need a CUDA device: imported once the arguments are read, so --help runs anywhere
    from bench.kernel_timing.attention import run_attention, run_attention_sweep
    from bench.kernel_timing.decode_attention import run_decode_attention
    from bench.kernel_timing.backward import run_head_backward, run_norm_backward, run_rope_backward
    from bench.kernel_timing.lora import run_lora_ops
    from bench.kernel_timing.matmul import MS, run_matmul, summarize
    from bench.kernel_timing.norms import run_host_overhead, run_norms
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    rep = 40 if args.quick else 100
    ms_list = [1, 64, 512, 4096] if args.quick else MS
    if args.ms:
        ms_list = [int(m) for m in args.ms.split(",")]
    only = set(args.only or ["matmul", "attention", "norms"])
    t0 = time.time()
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__}
    if "matmul" in only:
        rows, sweep_rows = run_matmul(ms_list, args.sweep, rep, args.shapes and args.shapes.split(","), args.model)
        doc["matmul_summary"] = summarize(rows)
        doc["matmul"] = rows
        if args.sweep:
            doc["sweep"] = sweep_rows
    if "attention" in only:
        doc["attention"] = run_attention(rep)
        if args.sweep:
            doc["attention_sweep"] = run_attention_sweep(rep)
    if "decode" in only:  # not in the default set: a sweep, about a minute
        doc["decode_attention"] = run_decode_attention(rep)
    if "lora" in only:  # not in the default set: a decode step's LoRA ops at Qwen2.5-1.5B shapes, r = 16
        doc["lora_ops"] = run_lora_ops(rep)
    if "backward" in only:  # not in the default set: the trainer's backward kernels against torch's ops
        doc["head_backward"] = run_head_backward(rep)
        doc["norm_backward"] = run_norm_backward(rep)
        doc["rope_backward"] = run_rope_backward(rep)
    if "norms" in only:
        doc.update(run_norms(rep))
        doc["host_overhead"] = run_host_overhead()
    doc["seconds"] = round(time.time() - t0, 1)
    emit(doc, args.out)


if __name__ == "__main__":
    main()
