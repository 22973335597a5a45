"""The device facts launch choices read: how many SMs there are, and how full their last wave is."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    """SMs of CUDA device `index` (4 under the Triton interpreter on CPU: small persistent grids)."""
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(index).multi_processor_count


def current_sms() -> int:
    """SMs of the current device; an H100's 132 where there is none (launch tables read on CPU)."""
    return num_sms(torch.cuda.current_device()) if torch.cuda.is_available() else 132


def wave_fill(programs: int, slots: int) -> float:
    """Share of `slots` concurrent program slots kept busy over the waves `programs` take (1.0: the
    last wave is full)."""
    waves = -(-programs // slots)
    return programs / (waves * slots)
