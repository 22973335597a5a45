"""Host arrays to the device without a device sync.

A plain `.to("cuda")` of a pageable tensor waits for the stream to drain; under vLLM's asynchronous
scheduling that stalls the host until the GPU has finished the previous step. Staging through pinned
memory makes the copy asynchronous; torch's caching host allocator keeps the pinned block until the
copy has run, so the host may reuse its arrays at once.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def _flat(arrays: Sequence[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([np.ascontiguousarray(a).reshape(-1) for a in arrays]))


def pinned(arrays: Sequence[np.ndarray]) -> torch.Tensor:
    """Arrays of one dtype concatenated (flat) into pinned host memory: an asynchronous copy source."""
    return _flat(arrays).pin_memory()


def stage(arrays: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Arrays of one dtype as tensors on `device` (same shapes), moved in one copy."""
    device = torch.device(device)
    if device.type == "cuda":
        flat = pinned(arrays).to(device, non_blocking=True)
    else:
        flat = _flat(arrays)
    return [part.view(a.shape) for part, a in zip(flat.split([a.size for a in arrays]), arrays)]
