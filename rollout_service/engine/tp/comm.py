"""The transport of a tensor-parallel group: the process group (tensors), its control channel (the
pickled messages rank 0 sends before each collective step) and the messages themselves."""
from __future__ import annotations

import dataclasses
import socket

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """Run this batch of chunks with the op set named `ops` (every rank, same collectives)."""
    ops: str
    chunks: list


@dataclasses.dataclass(frozen=True)
class LoadWeights:
    """Load full (TP=1) weights, or the staged ones when None; every rank reports its error or None."""
    state_dict: object = None


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """Leave serve_forever."""


@dataclasses.dataclass(frozen=True)
class TPContext:
    """A tensor-parallel group: `group` carries tensors (None = the default group), `control_group`
    the pickled batch messages (gloo, so that they never touch the GPU; None = `group`)."""
    group: object = None
    control_group: object = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def leader(self) -> int:
        """Global rank of the group's rank 0 (the sender of every message)."""
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    @property
    def _control(self):
        return self.control_group if self.control_group is not None else self.group

    def send(self, msg) -> None:
        dist.broadcast_object_list([msg], src=self.leader, group=self._control)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self._control)
        return box[0]

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._control)
        return out


def init_tp_group(rank: int, world_size: int, port: int, backend: str = "gloo",
                  addr: str = "127.0.0.1") -> TPContext:
    """Join the default process group (tcp://addr:port) and return its context; with NCCL a gloo
    group is added for the control messages."""
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size)
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    return TPContext(None, control)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
