"""Which implementation runs the canonical ops for a tensor: the Triton kernels for CUDA tensors
where Triton is installed (an optional dependency, imported on first use), else the reference."""
from __future__ import annotations

import functools

import torch

from . import reference


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
