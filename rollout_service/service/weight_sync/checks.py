"""The sender's check of a push's tensors: each finite floating point, and its fingerprint (what every
worker checks the bits it received against). Two passes give it: fingerprint_entries (streamed pushes:
the tensors are read again to send) and stage_tensors (staged pushes, in stage.py: the same pass fills
the buffer the push is sent from)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout_service.weights import WeightMismatchError, packed_rows

from .plan import DEFAULT_BUCKET_BYTES


def fingerprint_entries(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """(name, shape, fingerprint, device) per tensor, in order, after checking it is finite floating point.

    The tensors are fingerprinted and checked packed into bf16 buffers of `bucket_bytes` (packed_rows:
    fingerprints are per tensor, so this packing need not match the send's). Each tensor may be freed once
    the next is asked for (FSDP gathers one at a time)."""
    meta, bad = [], []

    def floating():
        for name, t in named:
            if not torch.is_floating_point(t):
                bad.append(name)
                continue
            meta.append((name, tuple(t.shape), t.device))
            yield t
    rows = packed_rows(floating(), bucket_bytes)
    return checked_entries(meta, rows, bad)


def checked_entries(meta: list, rows: list, bad: list[str]) -> list:
    """(name, shape, fingerprint, device) per tensor from its (name, shape, device) and its fingerprint
    row; raises naming the tensors that are not floating point (`bad`) or hold non-finite values."""
    bad = bad + [m[0] for m, (_, _, nonfinite) in zip(meta, rows) if nonfinite]
    if bad:
        raise WeightMismatchError(f"weights must be finite floating-point tensors: {bad[:5]}")
    return [(name, shape, (a, b), device) for (name, shape, device), (a, b, _) in zip(meta, rows)]


def check_digest(digest: str, expected: str | None) -> None:
    """The sender's check of the weights' digest against the one the caller expects."""
    if expected is not None and digest != expected:
        raise WeightMismatchError(f"the weights' digest is {digest}, expected {expected}")
