"""A worker's half of one bucketed push: each bucket received (by broadcast, or opened in place by
ipc), every tensor's bits checked against the sender's fingerprint, then loaded into the engine."""
from __future__ import annotations

import itertools
import pickle
import time
from collections.abc import Callable

import torch

from rollout_service.weights import WeightMismatchError, packed_fingerprints

from .groups import join_group
from .plan import SyncPlan, bucket_views, gpu_uuid, header


class WeightReceiver:
    """A worker's half of one push: receive each bucket, check every tensor's fingerprint against the
    sender's, then hand the tensors to `load` (the engine copies them into its weights in place)."""

    def __init__(self, plan: SyncPlan, device: torch.device, load: Callable[[list[tuple[str, torch.Tensor]]], None],
                 rank: int | None = None, world_size: int | None = None, groups: dict | None = None,
                 wait_reads: Callable[[], None] | None = None, ipc_buffers: dict | None = None,
                 wake: Callable[[], None] | None = None):
        """load may go on reading its tensors after it returns (VLLMEngine's host copy); wait_reads, where
        given, waits for those reads, and is called before the buffer is reused: in a push of several
        buckets (streamed), after each. A staged push's buffer holds all its buckets and is never reused.
        groups and ipc_buffers are the worker's, kept between pushes: its broadcast groups, and the one
        sender's buffer it opened by ipc (by handle). wake, where given, runs before every load (a
        sleeping engine wakes for the push's first load; after it, a no-op)."""
        self.plan, self.device, self._load, self._wait_reads = plan, torch.device(device), load, wait_reads
        self._wake = wake
        self._rank, self._world = rank, world_size
        self._groups = {} if groups is None else groups
        self._ipc_buffers = {} if ipc_buffers is None else ipc_buffers
        self._received: set[str] = set()
        self._ipc_buffer = None
        self.loaded_any = False
        self.declined = False  # a broadcast push whose header said no-go: nothing came, nothing was loaded
        self.error: Exception | None = None  # the first check that failed; later buckets are not loaded
        # where this worker's share of the push went, summed over buckets: receive (the broadcast; on
        # NCCL only queued, its transfer then waited for by check), check (fingerprints), wake (a
        # sleeping engine's), load (into the engine), settle (the device finishing the load); by ipc
        # also call (the worker's whole bucket calls, from their arrival: the rest of the sender's
        # send is Ray carrying them)
        self.seconds = {"receive": 0.0, "check": 0.0, "wake": 0.0, "load": 0.0, "settle": 0.0}

    def receive_all(self) -> None:
        """broadcast: every bucket, in order (blocks until the sender has sent them all), into a buffer of
        this push's own. Staged, the buffer holds the whole push and every receive is queued at once:
        a bucket is checked and loaded while the ones after it are in flight. Streamed, it holds one
        bucket, received once the last is loaded."""
        group = join_group(self.plan, self._rank, self._world, self._groups, replaces=[])
        # the header first, read on the host before any bucket's receive is queued: after a no-go the
        # sender sends nothing more. (Armed, this waits through the sender's training step.)
        first = header(self.plan, self.device)
        group.broadcast(first, 0).wait()
        go, *lanes = first.tolist()
        if not go:
            self.declined = True
            return
        self.plan.take_fingerprints(list(zip(lanes[0::2], lanes[1::2])))
        sizes = [b[-1].offset + b[-1].numel for b in self.plan.buckets]
        buf = torch.empty(sum(sizes) if self.plan.staged else max(sizes, default=0), dtype=torch.bfloat16,
                          device=self.device)
        firsts = list(itertools.accumulate([0, *sizes[:-1]])) if self.plan.staged else [0] * len(sizes)
        pieces = [buf[first:first + n] for first, n in zip(firsts, sizes)]
        queued = [group.broadcast(p.view(torch.uint8), 0) for p in pieces] if self.plan.staged else None
        for index, piece in enumerate(pieces):
            start = time.perf_counter()
            # received even after an error, so that the sender is never left waiting
            (queued[index] if queued else group.broadcast(piece.view(torch.uint8), 0)).wait()
            self.seconds["receive"] += time.perf_counter() - start
            self._take(index, piece)
        if self.error is not None:
            raise self.error

    def receive_ipc(self, index: int, handle, fingerprints: list | None = None, kept: bool = False) -> None:
        """ipc: bucket `index`, read in place from the sender's buffer; the first bucket's call is the go
        and carries every tensor's fingerprint (in the plan's order). kept: the buffer is a SenderStage
        the sender keeps between pushes, so this worker keeps it open too."""
        if fingerprints is not None:
            self.plan.take_fingerprints(fingerprints)
        if self.plan.fingerprints is None:
            raise ValueError("an ipc push's first bucket carries its fingerprints")
        if self._ipc_buffer is None:
            self._ipc_buffer = self._open(handle, kept)
        self._take(index, self._ipc_buffer)
        if self.error is not None:
            raise self.error

    def _open(self, handle, kept: bool) -> torch.Tensor:
        """The sender's buffer behind an ipc handle. A kept stage's buffer is opened once: the one this
        worker opened before when the handle is the same, else opened now and kept in place of it (a
        buffer that is not kept is let go at the push's end, so that the sender can free it). Rule: a
        handle names one CUDA allocation for as long as a receiver holds it open (torch keeps a shared
        block alive until its receivers let it go), so the same handle is the same memory; the stage is
        complete on the sender's device before the go (stage() waited for its fingerprints)."""
        if self.device.type != "cuda" or gpu_uuid(self.device) != self.plan.gpu_uuid:
            raise ValueError("transport='ipc' needs the worker on the sender's GPU; use 'broadcast'")
        rebuild, args = handle
        key = pickle.dumps(args)
        if key in self._ipc_buffers:
            return self._ipc_buffers[key]
        self._ipc_buffers.clear()  # one sender's stage at a time: a new one lets the last go
        # The handle names the sender's device index; the same GPU may have another index here (Ray
        # gives each actor its own CUDA_VISIBLE_DEVICES). Argument 6 of torch's rebuild_cuda_tensor is
        # that index.
        buf = rebuild(*args[:6], self.device.index or 0, *args[7:])
        if kept:
            self._ipc_buffers[key] = buf
        return buf

    def _take(self, index: int, buf: torch.Tensor) -> None:
        if self.error is not None:
            return
        bucket = self.plan.buckets[index]
        named = bucket_views(bucket, buf)
        start = time.perf_counter()
        got = packed_fingerprints(buf, [(e.offset, e.numel) for e in bucket]).tolist()
        checked = time.perf_counter()
        self.seconds["check"] += checked - start
        for (name, _), (a, b, _) in zip(named, got):
            if (a, b) != tuple(self.plan.fingerprints[name]):
                self.error = WeightMismatchError(f"{name}: the received bits differ from the sender's")
                return
        if self._wake is not None:
            self._wake()
        woken = time.perf_counter()
        self.seconds["wake"] += woken - checked
        self.loaded_any = True
        self._load(named)
        loaded = time.perf_counter()
        self.seconds["load"] += loaded - woken
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # on the device before the push counts as landed
        self.seconds["settle"] += time.perf_counter() - loaded
        if not self.plan.staged and len(self.plan.buckets) > 1 and self._wait_reads is not None:
            self._wait_reads()  # the buffer is written again by the next bucket (streamed pushes)
        self._received.update(n for n, _ in named)

    def finish(self) -> str:
        if self.error is not None:
            raise self.error
        missing = set(self.plan.shapes) - self._received
        if missing:
            raise WeightMismatchError(f"the push ended before {len(missing)} tensors arrived: {sorted(missing)[:5]}")
        self._ipc_buffer = None
        return self.plan.digest
