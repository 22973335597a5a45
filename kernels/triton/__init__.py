"""Triton GPU versions of the canonical ops (same signatures as kernels.reference).

Each op keeps the canonical numerics (docs/architecture.md, kernels/contract.py): a row's result
depends only on its own inputs.
The GPU results need not equal the CPU reference bit for bit; each must be invariant on its own.

Importing this package raises ImportError when triton or a CUDA device is missing, so that
kernels.backend_for falls back to the reference. TRITON_INTERPRET=1 lifts the device check (the
Triton interpreter runs the kernels on CPU tensors, for debugging only).
"""
from __future__ import annotations

import os

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except Exception as exc:  # a broken triton install must also mean "no GPU backend"
    raise ImportError(f"kernels.triton needs triton: {exc}") from exc

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRET and not torch.cuda.is_available():
    raise ImportError("kernels.triton needs a CUDA device")

from .attention import BLOCK_KV, attention, attention_packed, write_kv  # noqa: E402
from .elementwise import add, lora_add, rotary, rotary_qk, silu_mul  # noqa: E402
from .head_grad import logits_grad_  # noqa: E402
from .norm_grad import rms_norm_grads  # noqa: E402
from .lora import lora_expand_add  # noqa: E402
from .matmul import BLOCK_K, MMConfig, matmul, matmul_partials, matmul_with_config, pick_config  # noqa: E402
from . import moe  # noqa: E402  (grouped expert matmuls; kernels.moe dispatches to it)
from .norm import add_rms_norm, rms_norm  # noqa: E402
from .softmax import log_softmax, token_log_softmax  # noqa: E402
from . import sampling  # noqa: E402  (fused Gumbel-max sampling; kernels.sampling dispatches to it)

__all__ = ["BLOCK_K", "BLOCK_KV", "MMConfig", "add", "add_rms_norm", "attention", "attention_packed", "log_softmax", "lora_add",
           "lora_expand_add", "matmul",
           "matmul_partials", "matmul_with_config", "moe", "pick_config", "rms_norm", "rotary", "rotary_qk",
           "sampling", "silu_mul", "token_log_softmax", "write_kv"]
