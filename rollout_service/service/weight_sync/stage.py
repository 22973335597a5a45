"""A staged push's buffer: the whole push, cast to bf16, on the sender's device (one pass over the
weights), and how workers on the same GPU open it in place (CUDA IPC)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout_service.weights import CopyGroup, packed_fingerprints

from .checks import checked_entries

STAGE_COPY_GROUP_BYTES = 256 << 20  # the stage's copies are issued in groups of this many source bytes


def ipc_handle(buf: torch.Tensor):
    """What a worker on the same GPU opens `buf` from (torch's CUDA IPC form of a tensor)."""
    from torch.multiprocessing.reductions import reduce_tensor
    return reduce_tensor(buf)


class SenderStage:
    """A staged push's buffer kept by its sender between pushes (a trainer's rank 0 pushes the same
    shapes every step): allocated once, and by ipc shared once (its CUDA IPC handle), so a push pays
    neither again and every worker keeps the buffer it opened. Rule: a push writes the stage only once
    the last push from it has ended, the workers having read and loaded it."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self._handle = None

    def buffer(self, numel: int, device: torch.device) -> torch.Tensor:
        t = self.tensor
        if t is None or t.numel() != numel or t.device != torch.device(device):
            self.tensor, self._handle = torch.empty(numel, dtype=torch.bfloat16, device=device), None
        return self.tensor

    def ipc_handle(self):
        if self._handle is None:
            self._handle = ipc_handle(self.tensor)
        return self._handle


def stage_tensors(named: Iterable[tuple[str, torch.Tensor]], numel: int, kept: SenderStage | None):
    """The staged pass: every tensor cast to bf16 into one buffer of `numel` elements on their device
    (consecutive, in order: the buckets' layout; `kept`'s when given), then fingerprinted there in one
    launch. Returns (the buffer, fingerprint_entries' rows). Tensors are copied a group at a time
    (weights.CopyGroup): each may be freed once its group is copied. The cast is the copy's (round to
    nearest, as .to(torch.bfloat16)): float32 master weights need no bf16 copy of their own first."""
    layout, meta, bad, used = [], [], [], 0
    stage = None
    copies = CopyGroup(max_bytes=STAGE_COPY_GROUP_BYTES)
    for name, t in named:
        if not torch.is_floating_point(t):
            bad.append(name)
            continue
        n = t.numel()
        if used + n > numel:
            raise ValueError(f"stage(): the tensors hold more than the {numel} elements announced")
        if stage is None:
            stage = torch.empty(numel, dtype=torch.bfloat16, device=t.device) if kept is None \
                else kept.buffer(numel, t.device)
        copies.add(stage[used:used + n], t.detach().reshape(-1))
        meta.append((name, tuple(t.shape), t.device))
        layout.append((used, n))
        used += n
    copies.flush()
    if used != numel and not bad:
        raise ValueError(f"stage(): the tensors hold {used} elements, {numel} were announced")
    rows = packed_fingerprints(stage, layout).tolist() if layout else []
    return stage, checked_entries(meta, rows, bad)
