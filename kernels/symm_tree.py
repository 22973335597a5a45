"""The row-parallel tree over symmetric memory: each GPU reads the others' subtree nodes through
NVLink (torch.distributed._symmetric_memory peer buffers) instead of going through NCCL.

Why: a decode step makes two row-parallel products per layer, each summing a few MB. NCCL's
all-gather of the fp32 nodes, then separate combine / bias / cast kernels, cost several times a stock
engine's all-reduce (vLLM's is a peer-to-peer kernel too). Here one kernel reads the k nodes, adds them
in the tree's order, adds the bias and rounds (kernels.triton.peer_tree): the bits of
kernels.tp's "tree" reduction, with the data moved once.

Two schedules, the same adds:
  * "one_shot": every rank reads all k nodes for all N columns (k-1 remote fp32 reads per element);
  * "two_shot": rank r combines only its N/k columns and rounds them into its shared bf16 buffer, then
    every rank copies the others' rounded columns ((k-1)/k * (4 + 2) bytes per element, for large M).
Barriers (symmetric-memory signal pads, capturable in CUDA graphs) order the writes and the reads: the
nodes are complete before anyone reads them, and nobody overwrites a buffer a peer still reads.
"""
from __future__ import annotations

import importlib.util
import warnings

import torch
import torch.distributed as dist

SCHEDULES = ("one_shot", "two_shot")
TWO_SHOT_FROM_ELEMENTS = 1 << 21  # [512, 4096] and larger: the halved NVLink traffic beats the extra barrier
MIN_CAPACITY = 1 << 20  # elements (4 MB of fp32 nodes), so small first calls don't pin a tiny buffer


def symmetric_memory_available(device: torch.device) -> bool:
    """Whether this process can share GPU memory with its peers (CUDA and torch's symmetric memory)."""
    if torch.device(device).type != "cuda" or not dist.is_available():
        return False
    return importlib.util.find_spec("torch.distributed._symmetric_memory") is not None


class SymmetricTree:
    """The tree's top levels for one process group (all of whose ranks call it with equal shapes, in
    the same order). Buffers are allocated at the first call and grown when a larger call comes
    outside CUDA graph capture (a collective: every rank grows at the same call); a call larger than
    the buffers during capture returns None, and the caller uses its NCCL path (the same bits)."""

    def __init__(self, group, device: torch.device, capacity: int = 0, schedule: str | None = None):
        if schedule not in (None,) + SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES} or None (by size), got {schedule!r}")
        if not symmetric_memory_available(device):
            raise ValueError(f"the peer-to-peer tree needs CUDA tensors and torch symmetric memory, got {device}")
        from .triton import peer_tree  # CUDA only, so not at module level (default_reduce imports this module)
        self._kernels = peer_tree
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.schedule = schedule
        self.capacity = 0
        self._handle = None
        if capacity:
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        name = self.group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # required before torch 2.8, then deprecated
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(name):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(name)
        # fp32 nodes, then bf16 rounded columns (capacity / 2 fp32 words), in one symmetric allocation
        words = capacity + capacity // 2
        local = symm_mem.empty(words, dtype=torch.float32, device=self.device)
        handle = symm_mem.rendezvous(local, self.group)
        self._local = local
        self._handle = handle
        self.capacity = capacity
        self._nodes = [handle.get_buffer(r, (capacity,), torch.float32) for r in range(self.world_size)]
        self._rounded = [handle.get_buffer(r, (capacity,), torch.bfloat16, 2 * capacity)
                         for r in range(self.world_size)]

    def _ensure(self, numel: int) -> bool:
        if numel <= self.capacity:
            return True
        if torch.cuda.is_current_stream_capturing():
            return False
        self._handle = None  # the old buffers are freed once every rank has stopped using them
        torch.cuda.synchronize(self.device)
        dist.barrier(self.group)
        self._allocate(max(numel, MIN_CAPACITY, 2 * self.capacity))
        return True

    def pick_schedule(self, numel: int, out_dtype: torch.dtype) -> str:
        if self.schedule is not None:
            return self.schedule if out_dtype == torch.bfloat16 else "one_shot"
        # the shared rounded buffer holds bf16 only; other output dtypes take the one-shot schedule
        return "two_shot" if numel >= TWO_SHOT_FROM_ELEMENTS and out_dtype == torch.bfloat16 else "one_shot"

    def __call__(self, node: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
        """round(tree over the ranks' fp32 nodes [M, N] + bias) as [M, N] out_dtype; None when the call
        does not fit the buffers during CUDA graph capture."""
        peer_tree = self._kernels
        m, n = node.shape
        numel = m * n
        if not self._ensure(numel):
            return None
        k = self.world_size
        self._nodes[self.rank][:numel].view(m, n).copy_(node)
        self._handle.barrier(channel=0)  # every node written
        peers = [p[:numel].view(m, n) for p in self._nodes]
        out = torch.empty(m, n, dtype=out_dtype, device=node.device)
        if self.pick_schedule(numel, out_dtype) == "one_shot":
            peer_tree.combine_peers(peers, bias, out)
        else:
            cols = -(-n // k)
            mine = self._rounded[self.rank][:numel].view(m, n)
            peer_tree.combine_peer_columns(peers, bias, mine, self.rank * cols, cols)
            self._handle.barrier(channel=0)  # every rank's columns rounded
            peer_tree.gather_peer_columns([p[:numel].view(m, n) for p in self._rounded], out, cols)
        self._handle.barrier(channel=0)  # every read done: the buffers may be written again
        return out


__all__ = ["SCHEDULES", "SymmetricTree", "symmetric_memory_available"]
