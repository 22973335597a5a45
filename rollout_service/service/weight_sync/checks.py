"""The sender's check of a push's tensors: each finite floating point, and its fingerprint (what every
worker checks the bits it received against). Two passes give it: fingerprint_entries (streamed pushes:
the tensors are read again to send) and stage_tensors (staged pushes, in stage.py: the same pass fills
the buffer the push is sent from)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout_service.weights import WeightMismatchError, packed_fingerprints

from .plan import DEFAULT_BUCKET_BYTES


def fingerprint_entries(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """(name, shape, fingerprint, device) per tensor, in order, after checking it is finite floating point.

    The tensors are packed into bf16 buffers of `bucket_bytes` (fingerprints are per tensor, so this
    packing need not match the send's), and each buffer is fingerprinted and checked in one pass
    (weights.packed_fingerprints: a few launches per bucket, not per tensor; a push has hundreds of
    tensors). Each tensor may be freed once the next is asked for (FSDP gathers one at a time): it has
    been copied into the bucket, and the device is waited for once, at the end."""
    cap = max(1, int(bucket_bytes) // 2)
    meta, results, bad = [], [], []
    buf, layout = None, []
    for name, t in named:
        if not torch.is_floating_point(t):
            bad.append(name)
            continue
        meta.append((name, tuple(t.shape), t.device))
        n = t.numel()
        used = layout[-1][0] + layout[-1][1] if layout else 0
        if layout and (used + n > cap or buf.device != t.device):  # a new buffer
            results.append(packed_fingerprints(buf, layout))
            layout, used = [], 0
        if n > cap:  # a bucket of its own: fingerprinted where it is
            results.append(packed_fingerprints(t, [(0, n)]))
            continue
        if buf is None or buf.device != t.device:
            buf = torch.empty(cap, dtype=torch.bfloat16, device=t.device)
        buf[used:used + n].copy_(t.detach().reshape(-1))
        layout.append((used, n))
    if layout:
        results.append(packed_fingerprints(buf, layout))
    rows = [row for part in results for row in part.tolist()]  # the one wait for the device
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
