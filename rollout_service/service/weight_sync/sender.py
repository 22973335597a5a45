"""The sender's data path of one bucketed push, once the pool's workers wait for it: the go (by
broadcast the header, which carries every fingerprint; by ipc the first bucket's call), then every
bucket, copied into the bucket buffer (streamed) or sliced from the stage (staged)."""
from __future__ import annotations

import contextlib

import torch

from .groups import SENDER_GROUPS, join_group
from .plan import SyncPlan, header
from .stage import SenderStage, ipc_handle


def join_as_sender(plan: SyncPlan, info: dict):
    """The sender's member of the broadcast group that the pool's begin (`info`) names: the last group
    when it still fits, else a new one at this sender's store."""
    plan.group_id, plan.new_group = info["group_id"], info["new_group"]
    plan.store_host, plan.store_port = info["store"]
    return join_group(plan, 0, info["world_size"], SENDER_GROUPS, info["replaces"])


def send_no_go(plan: SyncPlan, info: dict, device: torch.device) -> None:
    """A broadcast push refused by its sender after the pool's begin: the header's no-go, on which every
    worker goes back to serving having loaded nothing (by ipc the push's end does that)."""
    if plan.transport == "broadcast":
        join_as_sender(plan, info).broadcast(header(plan, device), 0).wait()


class BucketSender:
    """The buckets of one push from `device`: `stage` (a staged push's buffer, the whole push) or, streamed,
    one bucket buffer of its own; `kept`, the SenderStage the stage may be, whose ipc handle the
    workers keep open. open() gives the go; send() every bucket; release() lets the buffers go."""

    def __init__(self, plan: SyncPlan, device: torch.device, stage: torch.Tensor | None, kept: SenderStage | None):
        self.plan, self._device, self._stage, self._kept = plan, device, stage, kept
        self._group = self._buf = self._handle = self._workers = None
        self._in_flight: torch.cuda.Stream | None = None  # a staged broadcast's stream, until its sends end

    def open(self, info: dict) -> None:
        """After the pool's begin (`info`): by broadcast the group and the go (the header); the buffer the
        buckets leave from, and by ipc its handle."""
        plan = self.plan
        self._workers = info["workers"]
        if plan.transport == "broadcast":  # the fingerprints go in the header
            try:
                self._group = join_as_sender(plan, info)
                self._group.broadcast(header(plan, self._device, go=True), 0).wait()
            except Exception as e:
                raise RuntimeError(f"the push's group failed before its go: a worker crashed, or gave the push "
                                   f"up after its {plan.timeout_s:g} s timeout ({type(e).__name__}: {e})") from e
        self._buf = self._stage if self._stage is not None else \
            torch.empty(plan.bucket_numel, dtype=torch.bfloat16, device=self._device)
        if plan.transport == "ipc":  # (the handle, whether it is the kept stage's, which workers keep open)
            kept = self._kept is not None and self._buf is self._kept.tensor
            self._handle = (self._kept.ipc_handle() if kept else ipc_handle(self._buf), kept)

    def send(self, tensors) -> None:
        """Every bucket: streamed, `tensors` (an iterator in the plan's order), each bucket sent as soon as
        it is full; staged (None), slices of the stage. A staged broadcast may still be leaving when this
        returns (in_flight)."""
        with self._send_stream():
            self._send_buckets(tensors)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @contextlib.contextmanager
    def _send_stream(self):
        """A staged broadcast's NCCL ops wait on a stream of the push's own, which wait_sent() waits for:
        a broadcast's wait() holds up the current stream until the receivers have the bucket, and a
        training step running meanwhile (a push sent behind the next step) must not wait for them."""
        if self._stage is None or self.plan.transport != "broadcast" or not self._buf.is_cuda:
            yield
            return
        stream = torch.cuda.Stream(self._buf.device)
        stream.wait_stream(torch.cuda.current_stream(self._buf.device))
        with torch.cuda.stream(stream):
            yield
        self._in_flight = stream

    def wait_sent(self) -> None:
        """Until every bucket has left (a staged broadcast's stream has run)."""
        stream, self._in_flight = self._in_flight, None
        if stream is not None:
            stream.synchronize()

    def _send_buckets(self, tensors) -> None:
        import ray
        first = 0  # the bucket's start in the stage
        for index, bucket in enumerate(self.plan.buckets):
            n = bucket[-1].offset + bucket[-1].numel
            if tensors is None:  # the stage is complete on the device: its fingerprints were waited for
                view, first = self._buf[first:first + n], first + n
            else:
                for entry in bucket:
                    name, t = next(tensors)
                    if name != entry.name:
                        raise ValueError(f"send() got {name!r} where the plan has {entry.name!r}")
                    self._buf[entry.offset:entry.offset + entry.numel].copy_(t.detach().reshape(-1))
                view = self._buf[:n]
                if self._buf.is_cuda:
                    torch.cuda.current_stream(self._buf.device).synchronize()
            if self.plan.transport == "broadcast":
                self._group.broadcast(view.view(torch.uint8), 0).wait()
            else:  # ipc: streamed, the bucket buffer; staged, the stage, which is the plan's one bucket. The
                # first bucket's call is the go: it carries the fingerprints
                prints = [self.plan.fingerprints[n] for n in self.plan.shapes] if index == 0 else None
                handle, kept = self._handle
                ray.get([w.receive_weight_bucket.remote(self.plan.sync_id, index, handle, prints, kept)
                         for w in self._workers])

    def release(self) -> None:
        if self._in_flight is not None:  # the stage is let go only once its sends have ended
            with contextlib.suppress(Exception):
                self._in_flight.synchronize()
            self._in_flight = None
        self._group = self._buf = self._handle = self._stage = None
