"""The plan of one bucketed push: the tensors (names and shapes, in the sender's order), the buckets
they are packed into, and how it crosses Ray. The sender makes it, the pool checks it, every receiver
follows it."""
from __future__ import annotations

import dataclasses
import pickle
import uuid
from dataclasses import dataclass, field

import torch

from rollout_service.lora import LoraAdapter, check_layout, projection_shapes_of_spec
from rollout_service.weights import WeightMismatchError, check_fit, digest_of_fingerprints

TRANSPORTS = ("object_store", "broadcast", "ipc")
BUCKETED = TRANSPORTS[1:]
DEFAULT_BUCKET_BYTES = 256 << 20
WHOLE = 1 << 62  # bucket_bytes of a plan with one bucket
DEFAULT_STAGE_BYTES = 8 << 30


def stages_whole(numel: int, stage_bytes: int) -> bool:
    """Rule: a push of `numel` elements is staged when its bf16 bytes fit in `stage_bytes` (one pass
    over the weights; the sender's device holds one more bf16 copy of them while it pushes), else it
    is streamed in buckets (two passes, one bucket held)."""
    return 2 * int(numel) <= int(stage_bytes)


@dataclass(frozen=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements of the bucket
    numel: int


@dataclass
class SyncPlan:
    """What the sender will send; the pool checks it and every receiver follows it."""

    transport: str
    # None until the go (the pool learns the digest from the sender's end)
    digest: str | None
    shapes: dict[str, tuple[int, ...]]  # in the sender's order, which is the order of the buckets
    fingerprints: dict[str, tuple[int, int]] | None
    bucket_bytes: int  # the buckets: plan_buckets(shapes, bucket_bytes)
    device_type: str  # "cuda" or "cpu": NCCL or gloo for broadcast
    timeout_s: float = 300.0
    sync_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # broadcast: the sender's TCPStore, and the process group (kept by both sides between pushes
    # while the pool's workers and the sender stay the same: set up once, like NCCL communicators
    # in every RL framework); ipc: the sender's GPU
    store_host: str | None = None
    store_port: int | None = None
    sender_id: str | None = None
    group_id: str | None = None
    new_group: bool = True
    gpu_uuid: str | None = None
    version: int | None = None  # the version id the receivers stamp later tokens with; set by the pool
    # the buckets lie one after another in the sender's stage: a receiver keeps them so too, in one
    # buffer of the whole push, so no bucket is written where another was
    staged: bool = False
    # a LoRA adapter push: {"name", LoraAdapter.settings()..., "expected": push_digest or None}; the
    # workers serve the tensors as that adapter (None: the model's weights)
    adapter: dict | None = None
    _buckets: list | None = field(default=None, init=False, repr=False, compare=False)

    # Rule: the buckets are derived, not shipped. Every side computes them from the shapes with the
    # same function, and a list of hundreds of entries was most of the plan's pickling, which each
    # push pays on the way to the pool and again to every worker.
    @property
    def buckets(self) -> list[list[BucketEntry]]:
        if self._buckets is None:
            self._buckets = plan_buckets(self.shapes, self.bucket_bytes)
        return self._buckets

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_buckets": None}

    # Rule: a plan crosses Ray as bytes of the standard pickler (the sender to the pool, the pool to
    # each worker). Ray's own serializer pickles objects with cloudpickle, in Python, on a call every
    # push waits for. A plan crosses without its fingerprints and digest: they travel with the go (a
    # broadcast's header, an ipc push's first bucket), so that the pool's begin may be asked before
    # the tensors exist.
    def to_wire(self) -> bytes:
        return pickle.dumps(dataclasses.replace(self, fingerprints=None, digest=None), protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def for_push(transport: str, shapes: dict[str, tuple[int, ...]], device: torch.device, staged: bool,
                 bucket_bytes: int, timeout_s: float, adapter: dict | None = None) -> SyncPlan:
        """A sender's plan of a push of these tensors from `device`. A staged push by ipc is one bucket:
        the workers read the whole stage in place in one call and check it in one launch. By broadcast
        it goes in buckets, slices of the stage sent back to back, so that a worker checks and loads each
        while the next is in flight (streamed, a worker takes each bucket in turn: receive, check, load,
        wait)."""
        if transport == "ipc" and device.type != "cuda":
            raise ValueError("transport='ipc' shares GPU memory; on CPU the object store is the shared-memory "
                             "path (transport='object_store')")
        plan = SyncPlan(transport, None, shapes, None, WHOLE if staged and transport == "ipc" else bucket_bytes,
                        device.type, timeout_s=timeout_s, staged=staged, adapter=adapter)
        if transport == "ipc":
            plan.gpu_uuid = gpu_uuid(device)
        return plan

    @staticmethod
    def from_wire(data: bytes) -> SyncPlan:
        plan = pickle.loads(data)
        if not isinstance(plan, SyncPlan):
            raise TypeError(f"expected a SyncPlan's wire form, got {type(plan).__name__}")
        return plan

    @property
    def bucket_numel(self) -> int:
        return max((b[-1].offset + b[-1].numel for b in self.buckets if b), default=0)

    def check(self, spec: dict[str, tuple[int, ...]] | None) -> None:
        """The pool's checks, before any worker is touched."""
        if self.transport not in BUCKETED:
            raise ValueError(f"transport must be one of {BUCKETED} for a bucketed push, got {self.transport!r}")
        if spec is None:
            raise ValueError(f"these workers cannot receive weights by {self.transport} (tensor-parallel "
                             f"workers take transport='object_store')")
        if self.adapter is None:
            check_fit(spec, self.shapes)
        else:
            check_layout(LoraAdapter.from_settings(self.adapter, {}), self.shapes, projection_shapes_of_spec(spec))
        if self.fingerprints is not None:
            raise ValueError("a push's fingerprints come with its go, not in its plan")

    def take_fingerprints(self, prints: list) -> None:
        """Set the fingerprints (in the order of shapes) and the digest they make."""
        if len(prints) != len(self.shapes):
            raise WeightMismatchError(f"{len(prints)} fingerprints for {len(self.shapes)} tensors")
        self.fingerprints = {n: (int(a), int(b)) for n, (a, b) in zip(self.shapes, prints)}
        self.digest = digest_of_fingerprints((n, self.shapes[n], self.fingerprints[n]) for n in self.shapes)


def plan_buckets(shapes: dict[str, tuple[int, ...]], bucket_bytes: int) -> list[list[BucketEntry]]:
    """Consecutive tensors (in `shapes`' order) packed into bf16 buckets of at most `bucket_bytes`; a
    larger tensor has a bucket of its own."""
    cap = max(1, bucket_bytes // 2)
    buckets, current, used = [], [], 0
    for name, shape in shapes.items():
        numel = 1
        for s in shape:
            numel *= int(s)
        if current and used + numel > cap:
            buckets.append(current)
            current, used = [], 0
        current.append(BucketEntry(name, tuple(int(s) for s in shape), used, numel))
        used += numel
    if current:
        buckets.append(current)
    return buckets


def bucket_views(bucket: list[BucketEntry], buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(e.name, buf[e.offset:e.offset + e.numel].view(e.shape)) for e in bucket]


def header(plan: SyncPlan, device: torch.device, go: bool = False) -> torch.Tensor:
    """A broadcast push's first broadcast: [go, then each tensor's two fingerprint lanes], int64. The
    sender's (go: filled from plan.fingerprints) or an empty one to receive into (or to send as the
    no-go)."""
    n = len(plan.shapes)
    if not go:
        return torch.zeros(1 + 2 * n, dtype=torch.int64, device=device)
    values = [1, *(lane for name in plan.shapes for lane in plan.fingerprints[name])]
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def choose_transport(requested: str, device: torch.device, worker_gpus: list[str | None]) -> str:
    """"auto": ipc when every worker is on the sender's GPU, broadcast when none is and all are on GPUs,
    else the object store; any other choice is returned as it is."""
    if requested not in (*TRANSPORTS, "auto"):
        raise ValueError(f"weight transport must be 'auto' or one of {TRANSPORTS}, got {requested!r}")
    if requested != "auto":
        return requested
    if device.type != "cuda" or not worker_gpus or None in worker_gpus:
        return "object_store"
    mine = gpu_uuid(device)
    if all(g == mine for g in worker_gpus):
        return "ipc"
    return "broadcast" if mine not in worker_gpus else "object_store"
