"""rms_norm and log_softmax against torch, and the host time of back-to-back small launches."""
from __future__ import annotations

import time

import torch

import kernels.triton as kt
from bench.kernel_timing.timing import bench_ms


def run_norms(rep: int):
    dev = "cuda"
    out = {"rms_norm": [], "log_softmax": []}
    n = 4096
    w = torch.randn(n, device=dev, dtype=torch.bfloat16)
    for m in (1, 64, 1024, 8192):
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        t_can = bench_ms(lambda: kt.rms_norm(x, w, 1e-5), rep=rep)
        t_torch = bench_ms(lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-5), rep=rep)
        out["rms_norm"].append({"M": m, "N": n, "canonical_ms": round(t_can, 4), "torch_ms": round(t_torch, 4),
                                "ratio": round(t_torch / t_can, 3)})
    v = 128256
    for m in (1, 64, 1024, 8192):
        x = torch.randn(m, v, device=dev, dtype=torch.float32)
        t_can = bench_ms(lambda: kt.log_softmax(x), rep=rep)
        t_torch = bench_ms(lambda: torch.log_softmax(x, dim=-1), rep=rep)
        out["log_softmax"].append({"M": m, "V": v, "canonical_ms": round(t_can, 4), "torch_ms": round(t_torch, 4),
                                   "ratio": round(t_torch / t_can, 3)})
        del x
    return out


def run_host_overhead():
    """Wall time per call of back-to-back small launches (host-bound: Python + Triton launch)."""
    dev = "cuda"
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device=dev, dtype=torch.bfloat16)
    wo = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    nw = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    calls = {"matmul_qkv_M1": lambda: kt.matmul(x, w), "matmul_o_tree8_M1": lambda: kt.matmul(x, wo, segments=8),
             "rms_norm_M1": lambda: kt.rms_norm(x, nw, 1e-5), "cublas_qkv_M1": lambda: torch.matmul(x, w.t()),
             "torch_rms_norm_M1": lambda: torch.nn.functional.rms_norm(x, (4096,), nw, 1e-5)}
    out = {}
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        out[name + "_us_per_call"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
    return out
