"""Weights from the trainer to the rollout workers in buckets, without the host: the plan both sides
follow, and each side's half of the two device transports.

- "broadcast": a torch.distributed process group of the sender (rank 0) and every worker, NCCL on
  GPUs (gloo on CPU); each bucket is one broadcast. For workers on other GPUs than the trainer.
- "ipc": the sender's bucket buffer is opened in place by workers on the same GPU through a CUDA IPC
  handle (colocated rollout and training). It has no CPU form: there the object store's shared
  memory is that path ("object_store": the whole state dict through ray.put).

Two ways to feed a push (the recipe picks by size, trainer.weight_stage_mb):
- staged: one pass casts every tensor into one buffer holding the whole push on the sender's device
  and fingerprints it there (WeightSender.stage); the checks and the send then read that buffer. By
  ipc it is one bucket: each worker reads all of it in one call. By broadcast its buckets are sent
  back to back, and each worker checks and loads one while the next is in flight.
- streamed: a check pass (fingerprint_entries), then a second pass that fills one bucket at a time
  (WeightSender.send): the sender never holds more than a bucket, at the price of gathering twice.

Safety rule: no weight reaches a worker before every check has passed on the sender (names and
shapes against the pool's model, finite values, the expected digest), so a refused push leaves every
worker serving the weights it had. Each worker then checks every received tensor's fingerprint
against the sender's before loading it, which catches a broken transfer; a worker that fails there
holds part of the new weights and is restarted by the pool.

A push's fingerprints travel with the sender's go: by broadcast in its first broadcast, the header
(the go, or a no-go, and every tensor's fingerprint); by ipc in the call that hands the workers the
first bucket. The pool's begin therefore needs only the names and shapes, and a sender may arm a
push (WeightSender.arm) before its tensors exist, while it trains: the pool drains and its workers
wait meanwhile (by broadcast, in the group). If the checks then fail, the no-go (a header saying so;
by ipc, the end of a push no bucket reached) sends every worker back to serving, having loaded
nothing.

A staged push's stage may be kept between pushes (SenderStage): allocated once and, by ipc, shared
once (its CUDA IPC handle), each worker keeping the buffer it opened from it (WeightReceiver's
ipc_buffers), so no push pays for allocating, sharing and opening the stage's memory again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import pickle
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from rollout_service.weights import (CopyGroup, WeightMismatchError, check_fit, digest_of_fingerprints,
                                     packed_fingerprints)

TRANSPORTS = ("object_store", "broadcast", "ipc")
DEFAULT_BUCKET_BYTES = 256 << 20
WHOLE = 1 << 62  # bucket_bytes of a plan with one bucket
DEFAULT_STAGE_BYTES = 8 << 30
STAGE_COPY_GROUP_BYTES = 256 << 20  # the stage's copies are issued in groups of this many source bytes


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
    # the buckets lie one after another in the sender's stage (WeightSender.stage): a receiver keeps
    # them so too, in one buffer of the whole push, so no bucket is written where another was
    staged: bool = False
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
    # each worker). Ray's own serializer pickles objects with cloudpickle, in Python: about 0.6 ms more
    # per call for a plan of 339 tensors, on a call every push waits for. A plan crosses without its
    # fingerprints and digest: they travel with the go (a broadcast's header, an ipc push's first
    # bucket), so that the pool's begin may be asked before the tensors exist.
    def to_wire(self) -> bytes:
        return pickle.dumps(dataclasses.replace(self, fingerprints=None, digest=None), protocol=pickle.HIGHEST_PROTOCOL)

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
        if self.transport not in TRANSPORTS[1:]:
            raise ValueError(f"transport must be one of {TRANSPORTS[1:]} for a bucketed push, got {self.transport!r}")
        if spec is None:
            raise ValueError(f"these workers cannot receive weights by {self.transport} (tensor-parallel "
                             f"workers take transport='object_store')")
        check_fit(spec, self.shapes)
        if self.fingerprints is not None:
            raise ValueError("a push's fingerprints come with its go, not in its plan")

    def take_fingerprints(self, prints: list, digest: str | None = None) -> None:
        """Set the fingerprints (in the order of shapes) and the digest they make; raises when `digest`
        is given and is not that one."""
        if len(prints) != len(self.shapes):
            raise WeightMismatchError(f"{len(prints)} fingerprints for {len(self.shapes)} tensors")
        self.fingerprints = {n: (int(a), int(b)) for n, (a, b) in zip(self.shapes, prints)}
        made = digest_of_fingerprints((n, self.shapes[n], self.fingerprints[n]) for n in self.shapes)
        if digest is not None and made != digest:
            raise WeightMismatchError("the push's digest does not match its fingerprints")
        self.digest = made


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


# This process's ID as a sender, and its broadcast groups by group id: (store, process group)
PROCESS_ID = uuid.uuid4().hex
_SENDER_GROUPS: dict[str, tuple] = {}


def join_group(plan: SyncPlan, rank: int, world_size: int, groups: dict[str, tuple], replaces: list[str]):
    """This process's member of the push's process group (rank 0: the sender, which hosts the store):
    `groups`' one for plan.group_id, or a new one; the groups named in `replaces` are dropped (their
    members changed, so they are not used again)."""
    if not plan.new_group:
        if plan.group_id not in groups:
            raise RuntimeError(f"weight group {plan.group_id} is not held by this process")
        return groups[plan.group_id][1]
    import torch.distributed as dist
    for old in replaces:
        groups.pop(old, None)
    timeout = datetime.timedelta(seconds=plan.timeout_s)
    store = dist.TCPStore(plan.store_host, plan.store_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(f"zerokl-weights-{plan.group_id}", store)
    if plan.device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    groups[plan.group_id] = (store, group)
    return group


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _views(bucket: list[BucketEntry], buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(e.name, buf[e.offset:e.offset + e.numel].view(e.shape)) for e in bucket]


def _header(plan: SyncPlan, device: torch.device, go: bool = False) -> torch.Tensor:
    """A broadcast push's first broadcast: [go, then each tensor's two fingerprint lanes], int64. The
    sender's (go: filled from plan.fingerprints) or an empty one to receive into."""
    n = len(plan.shapes)
    if not go:
        return torch.zeros(1 + 2 * n, dtype=torch.int64, device=device)
    values = [1, *(lane for name in plan.shapes for lane in plan.fingerprints[name])]
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


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
        header = _header(self.plan, self.device)
        group.broadcast(header, 0).wait()
        go, *lanes = header.tolist()
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
        named = _views(bucket, buf)
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


def _ipc_handle(buf: torch.Tensor):
    """What a worker on the same GPU opens `buf` from (torch's CUDA IPC form of a tensor)."""
    from torch.multiprocessing.reductions import reduce_tensor
    return reduce_tensor(buf)


class SenderStage:
    """A staged push's buffer kept by its sender between pushes (a trainer's rank 0 pushes the same
    shapes every step): allocated once, and by ipc shared once (its CUDA IPC handle), so a push pays
    neither again and every worker keeps the buffer it opened. Rule: a push writes the stage only once
    the last push from it has ended (WeightSender.finish), the workers having read and loaded it."""

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
            self._handle = _ipc_handle(self.tensor)
        return self._handle


class WeightSender:
    """The sender's half of one push, on the process that holds the full tensors (trainer rank 0, or
    any driver with a state dict on its device).

        sender = WeightSender(client, "ipc")
        sender.begin(sender.stage(named_tensors(), numel), expected_digest)   # staged: one pass
        digest = sender.complete()                                            # from the stage, then the verdict

        sender.begin(fingerprint_entries(named_tensors()), expected_digest)   # streamed: every check,
        digest = sender.complete(named_tensors())                             # then bucket by bucket

        sender = WeightSender(client, "ipc", stage=kept)   # kept: a SenderStage, the same every push
        sender.arm(shapes, device, staged=True)   # the pool's begin travels while the caller trains
        sender.begin(sender.stage(named_tensors(), numel))                    # checks, then the go
        digest = sender.complete()

    (push_state_dict does this for a state dict already on the device.)
    """

    def __init__(self, client, transport: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0,
                 stage: SenderStage | None = None):
        if transport not in TRANSPORTS[1:]:
            raise ValueError(f"WeightSender transport must be one of {TRANSPORTS[1:]}, got {transport!r}")
        self.client, self.transport, self._kept = client, transport, stage
        self.bucket_bytes, self.timeout_s = int(bucket_bytes), float(timeout_s)
        self.plan: SyncPlan | None = None
        self._group = self._workers = self._buf = self._handle = None
        self._armed = None  # the pool's begin, asked by arm() and not yet awaited
        self._plan_device = torch.device("cpu")
        self._asked_at = self._woken_at = 0.0  # when arm() asked the pool's begin; wake_workers its workers
        self._stage: torch.Tensor | None = None  # the whole push, after stage()
        self._in_flight: torch.cuda.Stream | None = None  # a staged broadcast's stream, until its sends end
        self._send_start = self._sent_at = 0.0
        # where the push's time went: begin (the pool's checks, its workers drained, the sender's
        # buffer; inside it begin_pool, the pool's own share, in which begin_checks, its checks, and
        # worker_begin, the slowest worker's), send (every bucket copied and sent), finish (the verdict,
        # from the end of the send), finish_pool (the pool's own share of the verdict: inside finish,
        # except for a staged broadcast, whose verdict is asked while its buckets are still leaving);
        # after finish, the workers' phases (worker_receive, worker_check, ...: WeightReceiver). Armed:
        # armed_ahead, from arm() to begin(); woken_ahead, from wake_workers() to begin()
        self.seconds: dict[str, float] = {}

    def stage(self, named: Iterable[tuple[str, torch.Tensor]], numel: int) -> list:
        """The staged pass: every tensor cast to bf16 into one buffer of `numel` elements on their device
        (consecutive, in order: the buckets' layout), then fingerprinted there in one launch; returns
        fingerprint_entries' rows for begin(). Tensors are copied a group at a time (weights.CopyGroup):
        each may be freed once its group is copied. The cast is the copy's (round to nearest, as
        .to(torch.bfloat16)): float32 master weights need no bf16 copy of their own first."""
        self.wake_workers()
        layout, meta, bad, used = [], [], [], 0
        copies = CopyGroup(max_bytes=STAGE_COPY_GROUP_BYTES)
        for name, t in named:
            if not torch.is_floating_point(t):
                bad.append(name)
                continue
            n = t.numel()
            if used + n > numel:
                raise ValueError(f"stage(): the tensors hold more than the {numel} elements announced")
            if self._stage is None:
                self._stage = torch.empty(numel, dtype=torch.bfloat16, device=t.device) if self._kept is None \
                    else self._kept.buffer(numel, t.device)
            copies.add(self._stage[used:used + n], t.detach().reshape(-1))
            meta.append((name, tuple(t.shape), t.device))
            layout.append((used, n))
            used += n
        copies.flush()
        if used != numel and not bad:
            raise ValueError(f"stage(): the tensors hold {used} elements, {numel} were announced")
        rows = packed_fingerprints(self._stage, layout).tolist() if layout else []
        return _checked_entries(meta, rows, bad)

    def arm(self, shapes: dict[str, tuple[int, ...]], device: torch.device, staged: bool) -> None:
        """Start the pool's begin for a push of these tensors (names and shapes in the order they will
        come; staged: whether stage() will feed it) before they exist, e.g. before the training step
        that makes them. The call travels, the pool drains and its workers wait (by broadcast, in the
        group) while the caller works; begin() then checks the tensors and gives the go (the header, or
        by ipc the first bucket), or the no-go if a check fails. Returns at once; the pool's refusal
        (names, shapes) is raised by begin()."""
        if self.plan is not None:
            raise RuntimeError("this sender has already begun a push")
        self._new_plan({n: tuple(s) for n, s in shapes.items()}, torch.device(device), staged)
        self._armed = self._ask_begin()

    def wake_workers(self) -> None:
        """An armed ipc push: its workers are asked to wake their engines now (not waited for), so that a
        sleeping engine maps its memory back while the caller goes on, not in the push's first load.
        Rule: ask once the work the engines slept for has ended, as a trainer rank does after its
        step's last backward (RankWeightPush.wake_engines); stage() asks as it starts, the tensors
        existing by then. Asked once a push, and only once the pool's begin has answered (it names the
        workers; a refusal is begin()'s to raise); an engine still asleep at the first load wakes there."""
        if self._armed is None or self.transport != "ipc" or self._woken_at:
            return
        import ray
        if not ray.wait([self._armed], timeout=0)[0]:
            return
        try:
            workers = self.client._await_begin(self._armed)["workers"]
        except Exception:
            return
        self._woken_at = time.perf_counter()
        for worker in workers:
            worker.wake.remote()

    def _new_plan(self, shapes: dict[str, tuple[int, ...]], device: torch.device, staged: bool) -> None:
        # a staged push by ipc is one bucket: the workers read the whole stage in place in one call and
        # check it in one launch. By broadcast it goes in buckets, slices of the stage sent back to back,
        # so that a worker checks and loads each while the next is in flight (streamed, a worker takes
        # each bucket in turn: receive, check, load, wait).
        if self.transport == "ipc" and device.type != "cuda":
            raise ValueError("transport='ipc' shares GPU memory; on CPU the object store is the shared-memory "
                             "path (transport='object_store')")
        bucket_bytes = WHOLE if staged and self.transport == "ipc" else self.bucket_bytes
        self.plan = SyncPlan(self.transport, None, shapes, None, bucket_bytes, device.type,
                             timeout_s=self.timeout_s, staged=staged)
        if self.transport == "ipc":
            self.plan.gpu_uuid = gpu_uuid(device)
        self._plan_device = device

    @property
    def armed(self) -> bool:
        """arm() has asked the pool's begin, and begin() or decline() has not yet answered it."""
        return self._armed is not None

    def _ask_begin(self):
        self._asked_at = time.perf_counter()
        if self.transport == "broadcast":
            self.plan.store_host, self.plan.store_port = _host_and_free_port()
            self.plan.sender_id = PROCESS_ID
        return self.client._begin_weight_sync(self.plan, wait=False)

    def begin(self, entries: list[tuple[str, tuple, tuple[int, int], torch.device]],
              expected_digest: str | None = None) -> str:
        """Check the push (fingerprint_entries' output) and have the pool's workers wait for it; raises
        WeightMismatchError / ValueError before any weight reaches a worker (armed: after the header's
        no-go has sent every worker back to serving)."""
        shapes = {name: tuple(shape) for name, shape, _, _ in entries}
        prints = [fp for _, _, fp, _ in entries]
        staged = self._stage is not None
        armed = self._armed is not None
        try:
            if armed and (shapes != self.plan.shapes or staged != self.plan.staged):
                raise ValueError("the push's tensors are not the ones it was armed for (names, shapes, order "
                                 "or staging differ)")
            if not armed:
                self._new_plan(shapes, entries[0][3] if entries else torch.device("cpu"), staged)
            self.plan.take_fingerprints(prints)
            digest = self.plan.digest
            if expected_digest is not None and digest != expected_digest:
                raise WeightMismatchError(f"the weights' digest is {digest}, expected {expected_digest}")
        except BaseException as e:
            if armed:
                self.decline(f"the sender's checks refused the push: {e}")
            raise
        start = time.perf_counter()
        # the pool's checks; its workers drained and waiting (armed: asked before, maybe answered already)
        ref, self._armed = (self._armed if armed else self._ask_begin()), None
        info = self.client._await_begin(ref)
        self._workers = info["workers"]
        self.seconds.update({"begin_pool": info["seconds"]["pool"], "begin_checks": info["seconds"]["checks"],
                             "worker_begin": info["seconds"]["worker"]})
        plan = self.plan
        plan.version = info["version"]  # the pool's version id of this push
        try:
            if self.transport == "broadcast":  # the fingerprints go in the header
                try:
                    self._group = self._join(info)
                    self._group.broadcast(_header(plan, self._plan_device, go=True), 0).wait()
                except Exception as e:
                    raise RuntimeError(f"the push's group failed before its go: a worker crashed, or gave the push "
                                       f"up after its {self.timeout_s:g} s timeout ({type(e).__name__}: {e})") from e
            self._buf = self._stage if self._stage is not None else \
                torch.empty(plan.bucket_numel, dtype=torch.bfloat16, device=self._plan_device)
            if self.transport == "ipc":  # (the handle, whether it is the kept stage's, which workers keep open)
                kept = self._kept is not None and self._buf is self._kept.tensor
                self._handle = (self._kept.ipc_handle() if kept else _ipc_handle(self._buf), kept)
        except BaseException as e:  # the workers are waiting: release them
            self.abort(f"the sender could not set up the push: {e!r}")
            raise
        self.seconds["begin"] = time.perf_counter() - start
        if armed:  # from the arm call: what begin took where it was not hidden behind the caller's work
            self.seconds["armed_ahead"] = start - self._asked_at
        if self._woken_at:  # how long before the begin the workers were asked to wake
            self.seconds["woken_ahead"] = start - self._woken_at
        return digest

    def _join(self, info: dict):
        """The sender's member of the broadcast group that the pool's begin (`info`) names: the last
        group when it still fits, else a new one at this sender's store."""
        self.plan.group_id, self.plan.new_group = info["group_id"], info["new_group"]
        self.plan.store_host, self.plan.store_port = info["store"]
        return join_group(self.plan, 0, info["world_size"], _SENDER_GROUPS, info["replaces"])

    def decline(self, reason: str) -> None:
        """An armed push refused by the sender: the no-go (a broadcast's header saying so; by ipc, the
        push's end before any bucket) sends every worker back to serving with nothing loaded (the pool
        restarts none); where a header cannot be sent, the push is abandoned."""
        ref, self._armed = self._armed, None
        try:
            info = self.client._await_begin(ref)
        except Exception:  # the pool refused it too: no worker waits
            self._release()
            return
        try:
            if self.transport == "broadcast":
                self._join(info).broadcast(_header(self.plan, self._plan_device), 0).wait()
        except Exception as e:
            self.abort(f"{reason}; and the no-go could not be sent: {e!r}")
            return
        try:
            self.client._end_weight_sync(self.plan.sync_id, error=reason, declined=True)
        except Exception:  # the pool's "abandoned" is expected; the sender raises its own refusal
            pass
        finally:
            self._release()

    def send(self, named: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Every bucket: streamed, the tensors in begin()'s order, each bucket sent as soon as it is full;
        staged (named is None), slices of the stage."""
        if (named is None) != (self._stage is not None):
            raise ValueError("send() takes the tensors of a streamed push, and nothing after stage()")
        self._send_start = time.perf_counter()
        tensors = None if named is None else iter(named)
        with self._send_stream():
            self._send_buckets(tensors)
        if self._in_flight is None:
            self._wait_sent()

    @contextlib.contextmanager
    def _send_stream(self):
        """A staged broadcast's NCCL ops wait on a stream of the push's own, which finish() waits for
        (_wait_sent): a broadcast's wait() holds up the current stream until the receivers have the
        bucket, and a training step running meanwhile (a push sent behind the next step) must not wait
        for them."""
        if self._stage is None or self.transport != "broadcast" or not self._buf.is_cuda:
            yield
            return
        stream = torch.cuda.Stream(self._buf.device)
        stream.wait_stream(torch.cuda.current_stream(self._buf.device))
        with torch.cuda.stream(stream):
            yield
        self._in_flight = stream

    def _wait_sent(self) -> None:
        """Until every bucket has left (a staged broadcast's stream has run); the send's seconds end here."""
        stream, self._in_flight = self._in_flight, None
        if stream is not None:
            stream.synchronize()
        self._sent_at = time.perf_counter()
        self.seconds["send"] = self._sent_at - self._send_start

    def _send_buckets(self, tensors) -> None:
        import ray
        first = 0  # the bucket's start in the stage
        for index, bucket in enumerate(self.plan.buckets):
            n = bucket[-1].offset + bucket[-1].numel
            if tensors is None:  # the stage is complete on the device: stage() waited for its fingerprints
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
            if self.transport == "broadcast":
                self._group.broadcast(view.view(torch.uint8), 0).wait()
            else:  # ipc: streamed, the bucket buffer; staged, the stage, which is the plan's one bucket. The
                # first bucket's call is the go: it carries the fingerprints
                prints = [self.plan.fingerprints[n] for n in self.plan.shapes] if index == 0 else None
                handle, kept = self._handle
                ray.get([w.receive_weight_bucket.remote(self.plan.sync_id, index, handle, prints, kept)
                         for w in self._workers])

    def complete(self, named: Iterable[tuple[str, torch.Tensor]] | None = None) -> str:
        """send() then finish(); a failure while sending abandons the push (abort) and is raised."""
        try:
            self.send(named)
        except BaseException as e:
            self.abort(f"the sender failed while sending: {e!r}")
            raise
        return self.finish()

    def finish(self) -> str:
        """The pool's verdict once every worker has checked and loaded everything: the digest they hold.
        The workers' own phases (the slowest worker's, each) join self.seconds as worker_<phase>.

        Rule: a staged broadcast's end is asked for as soon as its buckets are queued, and only then is
        their stream waited for: the call to the pool travels while the buckets do (the workers answer
        once they have them all, so the verdict cannot come early). finish's seconds start once the
        buckets have left."""
        self._sent_at = time.perf_counter()
        try:
            then = self._wait_sent if self._in_flight is not None else None
            verdict = self.client._end_weight_sync(self.plan.sync_id, then=then, digest=self.plan.digest)
            self.seconds["finish_pool"] = verdict["seconds"]
            self.seconds.update({f"worker_{k}": v for k, v in verdict["worker_seconds"].items()})
            return verdict["digest"]
        finally:
            self.seconds["finish"] = time.perf_counter() - self._sent_at
            self._release()

    def abort(self, reason: str) -> None:
        try:
            self.client._end_weight_sync(self.plan.sync_id, error=reason)
        except Exception:
            pass
        finally:
            self._release()

    def _release(self) -> None:
        if self._in_flight is not None:  # the stage is let go only once its sends have ended
            with contextlib.suppress(Exception):
                self._in_flight.synchronize()
            self._in_flight = None
        self._group = self._buf = self._handle = self._stage = None


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
    return _checked_entries(meta, rows, bad)


def _checked_entries(meta: list, rows: list, bad: list[str]) -> list:
    """(name, shape, fingerprint, device) per tensor from its (name, shape, device) and its fingerprint
    row; raises naming the tensors that are not floating point (`bad`) or hold non-finite values."""
    bad = bad + [m[0] for m, (_, _, nonfinite) in zip(meta, rows) if nonfinite]
    if bad:
        raise WeightMismatchError(f"weights must be finite floating-point tensors: {bad[:5]}")
    return [(name, shape, (a, b), device) for (name, shape, device), (a, b, _) in zip(meta, rows)]


def push_state_dict(client, state_dict, transport: str, expected_digest: str | None = None,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, stage_bytes: int = DEFAULT_STAGE_BYTES) -> str:
    """A whole state dict (tensors on the sender's device) to every worker of `client`'s pool."""
    named = list(state_dict.items())
    sender = WeightSender(client, transport, bucket_bytes)
    numel = sum(t.numel() for _, t in named)
    if stages_whole(numel, stage_bytes):
        sender.begin(sender.stage(named, numel), expected_digest)
        return sender.complete()
    sender.begin(fingerprint_entries(named, bucket_bytes), expected_digest)
    return sender.complete(named)


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


def _host_and_free_port() -> tuple[str, int]:
    import socket
    try:
        import ray
        host = ray.util.get_node_ip_address()
    except Exception:
        host = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


def iter_full_tensors(model: torch.nn.Module, dtype=torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per entry of the model's state dict, on its device, cast to `dtype` (None: as
    stored, for a reader that casts as it copies, such as WeightSender.stage); an FSDP2 (DTensor) shard
    is gathered one parameter at a time (a collective: every rank must iterate in step)."""
    for name, t in model.state_dict().items():
        t = _whole(t).detach()
        yield name, t if dtype is None else t.to(dtype)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a state-dict entry. On a one-rank mesh an FSDP2 shard is the whole
    parameter, so it is taken as it is: full_tensor() there is no copy but still a collective and a
    DTensor dispatch, and a push makes two passes over hundreds of tensors (about 0.15 s a pass at
    1.5B parameters on an H200)."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.device_mesh.size() == 1:
        local = t.to_local()
        if local.shape == t.shape:
            return local
    return t.full_tensor()
