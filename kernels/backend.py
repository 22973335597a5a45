"""Which implementation runs the canonical ops for a tensor: the Triton kernels for CUDA tensors
where Triton is installed (an optional dependency, imported on first use), else the reference; and
so which contract (kernels.contract) a device's canonical forward runs under."""
from __future__ import annotations

import functools

import torch

from . import reference
from .contract import KERNELS_VERSION, REFERENCE, TRITON, CanonicalConfig, KernelFamily, tree_segments


@functools.lru_cache(maxsize=None)
def triton_backend():
    """kernels.triton, or None where Triton (or a GPU) is missing."""
    try:
        from . import triton as backend  # noqa: F401
    except ImportError:
        return None
    return backend


def backend_for(t: torch.Tensor):
    """The module implementing the canonical ops for tensors on t's device."""
    if t.is_cuda:
        backend = triton_backend()
        if backend is not None:
            return backend
    return reference


def kernel_family(device: torch.device | str) -> KernelFamily:
    """The family that runs the canonical ops for tensors on `device` (as backend_for picks)."""
    return TRITON if torch.device(device).type == "cuda" and triton_backend() is not None else REFERENCE


def canonical_config(device: torch.device | str = "cpu") -> CanonicalConfig:
    """The contract of canonical ops run on `device` in this process."""
    family = kernel_family(device)
    return CanonicalConfig(KERNELS_VERSION, torch.device(device).type, family.name, family.matmul_block_k,
                           family.attention_block_kv, family.attention_split_kv, tree_segments())
