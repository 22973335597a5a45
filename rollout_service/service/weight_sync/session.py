"""WeightPush: one push of a model's weights from this process to every worker of a rollout pool."""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from rollout_service.lora import LoraAdapter
from rollout_service.service.switch_modes import DRAIN, check_switch_mode
from rollout_service.weights import check_state_dict_types, state_dict_digest

from .checks import check_digest, fingerprint_entries
from .groups import PROCESS_ID, host_and_free_port
from .plan import DEFAULT_BUCKET_BYTES, DEFAULT_STAGE_BYTES, SyncPlan, choose_transport, stages_whole
from .sender import BucketSender, send_no_go
from .stage import SenderStage, stage_tensors


class WeightPush:
    """One push to the workers of `pool` (a RolloutClient), from tensors on this process's `device`.

    Lifecycle, each step once and in this order:

        push = WeightPush(pool, transport, device)   # "auto" resolved here (choose_transport)
        push.announce(shapes, device, staged)        # optional: the pool drains and its workers wait
                                                     # while the caller still makes the tensors
        push.wake()                                  # optional, announced ipc: the engines wake now
        digest = push.check(tensors, numel)          # every check, this side's then the pool's; no
                                                     # weight has reached a worker yet
        digest = push.send(tensors)                  # the buckets; the pool's verdict: the digest that
                                                     # every worker now holds
        push.cancel(reason)                          # instead of send: the workers serve again, having
                                                     # loaded nothing
        digest = push.load(state_dict, expected)     # check then send of a whole state dict; the only
                                                     # form of transport "object_store"

    check() stages the push when given `numel` (the whole push cast into one buffer on the device: one
    pass over the tensors, and send() takes nothing) and otherwise streams it (send() takes the same
    tensors again and fills one bucket at a time). A check or send that fails ends the push itself
    (every worker released; one that holds part of the push is restarted by the pool) and raises.
    The transports and the protocol behind these calls: rollout_service.service.weight_sync.
    """

    def __init__(self, pool, transport: str = "auto", device: torch.device | None = None, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, stage_bytes: int = DEFAULT_STAGE_BYTES,
                 timeout_s: float = 300.0, stage: SenderStage | None = None, mode: str = DRAIN,
                 adapter: tuple[str, dict, str | None] | None = None):
        check_switch_mode(mode)
        if mode != DRAIN and transport != "object_store":
            raise ValueError(f"transport {transport!r} pushes in buckets, which switch in 'drain' mode only; "
                             f"use transport='object_store' for mode={mode!r}")
        gpus = [w["gpu"] for w in pool.stats()["workers"]] if transport == "auto" else []
        self.transport = choose_transport(transport, torch.device(device or "cpu"), gpus)
        self.pool, self.mode, self._kept = pool, mode, stage
        self.bucket_bytes, self.stage_bytes, self.timeout_s = int(bucket_bytes), int(stage_bytes), float(timeout_s)
        self.plan: SyncPlan | None = None
        self.digest: str | None = None  # the weights' digest, once checked
        # a LoRA adapter push, (name, LoraAdapter.settings(), the expected push_digest of adapter and base,
        # which the workers check: they know their base): SyncPlan.adapter
        self.adapter = None if adapter is None else {"name": adapter[0], **adapter[1], "expected": adapter[2]}
        self._armed = None  # the pool's begin, asked by announce() and not yet awaited
        self._plan_device = torch.device("cpu")
        self._stage: torch.Tensor | None = None  # the whole push, after a staged check
        self._sender: BucketSender | None = None  # from the pool's begin until the push ends
        self._asked_at = self._woken_at = self._send_start = self._sent_at = 0.0
        # where the push's time went: begin (inside it begin_pool, the pool's share, with begin_checks and
        # worker_begin, the slowest worker's), send, finish (the verdict, from the end of the send; inside
        # it finish_pool, the pool's share), the workers' phases (worker_<phase>: WeightReceiver.seconds);
        # announced, armed_ahead (from announce() to the begin) and woken_ahead (from wake() to it)
        self.seconds: dict[str, float] = {}

    @property
    def armed(self) -> bool:
        """announce() has asked the pool's begin, and check() or cancel() has not yet answered it."""
        return self._armed is not None

    def load(self, state_dict, expected_digest: str | None = None) -> str:
        """A whole state dict (name -> tensor, on this process's device) checked and sent: staged when it
        fits in stage_bytes (stages_whole), else streamed. Returns the digest every worker holds."""
        check_state_dict_types(state_dict)
        if self.transport == "object_store":
            import ray
            self.digest = state_dict_digest(state_dict)
            check_digest(self.digest, expected_digest)
            # One object for all workers. This process owns it; the pool keeps the ref for restarts.
            sent = state_dict if self.adapter is None else LoraAdapter.from_settings(self.adapter, state_dict)
            return self.pool._switch_weights(ray.put(sent), self.digest, self.mode, self.adapter)
        named = list(state_dict.items())
        numel = sum(t.numel() for _, t in named)
        staged = stages_whole(numel, self.stage_bytes)
        self.check(named, numel if staged else None, expected_digest)
        return self.send(None if staged else named)

    def announce(self, shapes: dict[str, tuple[int, ...]], device: torch.device, staged: bool) -> None:
        """Ask the pool's begin for a push of these tensors (names and shapes in the order they will come;
        staged: whether check() will be given numel) before they exist, e.g. before the training step
        that makes them. Returns at once; the pool's refusal (names, shapes) is raised by check()."""
        if self.plan is not None:
            raise RuntimeError("this push has already begun")
        self._plan_device = device = torch.device(device)
        self.plan = SyncPlan.for_push(self.transport, {n: tuple(s) for n, s in shapes.items()}, device, staged,
                                      self.bucket_bytes, self.timeout_s, self.adapter)
        self._armed = self._ask_begin()

    def wake(self) -> None:
        """An announced ipc push: its workers are asked to wake their engines now (not waited for), so that
        a sleeping engine maps its memory back while the caller goes on, not in the push's first load.
        Rule: ask once the work the engines slept for has ended (a trainer rank: after its step's last
        backward; a staged check asks as it starts). Asked once, and only once the pool's begin has
        answered (it names the workers); an engine still asleep at the first load wakes there."""
        if self._armed is None or self.transport != "ipc" or self._woken_at:
            return
        import ray
        if not ray.wait([self._armed], timeout=0)[0]:
            return
        try:
            workers = self.pool._await_begin(self._armed)["workers"]
        except Exception:
            return
        self._woken_at = time.perf_counter()
        for worker in workers:
            worker.wake.remote()

    def check(self, tensors: Iterable[tuple[str, torch.Tensor]], numel: int | None = None,
              expected_digest: str | None = None) -> str:
        """Check the push's tensors (finite floating point; announced: the names and shapes announced; the
        expected digest), then have the pool check it against its model and its workers wait for the
        buckets. Staged when `numel` (the tensors' element count) is given. Returns the weights'
        digest; raises WeightMismatchError / ValueError before any weight reaches a worker."""
        if self.transport == "object_store":
            raise ValueError("an object-store push takes a whole state dict: load()")
        if self.plan is not None and not self.armed:
            raise RuntimeError("this push has already been checked")
        try:
            if numel is None:
                entries = fingerprint_entries(tensors, self.bucket_bytes)
            else:
                self.wake()
                self._stage, entries = stage_tensors(tensors, numel, self._kept)
            self._take(entries, expected_digest)
        except BaseException as e:
            if self.armed:  # the no-go: every waiting worker serves again, having loaded nothing
                self._decline(f"the sender's checks refused the push: {e}")
            raise
        self._begin()
        return self.digest

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> str:
        """Every bucket (streamed: `tensors` again, in check()'s order; staged: None), then the pool's
        verdict once every worker has checked and loaded everything: the digest they hold. The workers'
        own phases (the slowest worker's, each) join self.seconds as worker_<phase>. A failure while
        sending gives the push up and is raised."""
        try:
            if (tensors is None) != (self._stage is not None):
                raise ValueError("send() takes the tensors of a streamed push, and nothing after a staged check")
            self._send_start = time.perf_counter()
            self._sender.send(None if tensors is None else iter(tensors))
            if not self._sender.in_flight:
                self._wait_sent()
        except BaseException as e:
            self._abort(f"the sender failed while sending: {e!r}")
            raise
        return self._finish()

    def cancel(self, reason: str) -> None:
        """A push that will not be sent: its workers serve again (announced and not checked, having loaded
        nothing; checked, the push is abandoned). A no-op once the push has ended."""
        if self.armed:
            self._decline(reason)
        elif self._sender is not None:
            self._abort(reason)

    def _ask_begin(self):
        self._asked_at = time.perf_counter()
        if self.transport == "broadcast":
            self.plan.store_host, self.plan.store_port = host_and_free_port()
            self.plan.sender_id = PROCESS_ID
        return self.pool._begin_weight_sync(self.plan, wait=False)

    def _take(self, entries: list, expected_digest: str | None) -> None:
        """This side's checks of fingerprint_entries' rows: the announced names and shapes, the digest."""
        shapes = {name: tuple(shape) for name, shape, _, _ in entries}
        staged = self._stage is not None
        if self.armed:
            if shapes != self.plan.shapes or staged != self.plan.staged:
                raise ValueError("the push's tensors are not the ones it was armed for (names, shapes, order "
                                 "or staging differ)")
        else:
            self._plan_device = entries[0][3] if entries else torch.device("cpu")
            self.plan = SyncPlan.for_push(self.transport, shapes, self._plan_device, staged, self.bucket_bytes,
                                          self.timeout_s, self.adapter)
        self.plan.take_fingerprints([fp for _, _, fp, _ in entries])
        self.digest = self.plan.digest
        check_digest(self.digest, expected_digest)

    def _begin(self) -> None:
        """The pool's checks; its workers drained and waiting (announced: asked before, maybe answered
        already); then the go."""
        start = time.perf_counter()
        armed = self.armed
        ref, self._armed = (self._armed if armed else self._ask_begin()), None
        info = self.pool._await_begin(ref)
        self.seconds.update({"begin_pool": info["seconds"]["pool"], "begin_checks": info["seconds"]["checks"],
                             "worker_begin": info["seconds"]["worker"]})
        self.plan.version = info["version"]  # the pool's version id of this push
        self._sender = BucketSender(self.plan, self._plan_device, self._stage, self._kept)
        try:
            self._sender.open(info)
        except BaseException as e:  # the workers are waiting: release them
            self._abort(f"the sender could not set up the push: {e!r}")
            raise
        self.seconds["begin"] = time.perf_counter() - start
        if armed:  # from announce(): what begin took where it was not hidden behind the caller's work
            self.seconds["armed_ahead"] = start - self._asked_at
        if self._woken_at:  # how long before the begin the workers were asked to wake
            self.seconds["woken_ahead"] = start - self._woken_at

    def _wait_sent(self) -> None:
        """Until every bucket has left; the send's seconds end here."""
        self._sender.wait_sent()
        self._sent_at = time.perf_counter()
        self.seconds["send"] = self._sent_at - self._send_start

    def _finish(self) -> str:
        """The pool's verdict. Rule: a staged broadcast's end is asked for as soon as its buckets are
        queued, and only then is their stream waited for: the call to the pool travels while the buckets
        do (the workers answer once they have them all, so the verdict cannot come early). finish's
        seconds start once the buckets have left."""
        self._sent_at = time.perf_counter()
        try:
            then = self._wait_sent if self._sender.in_flight else None
            verdict = self.pool._end_weight_sync(self.plan.sync_id, then=then, digest=self.plan.digest)
            self.seconds["finish_pool"] = verdict["seconds"]
            self.seconds.update({f"worker_{k}": v for k, v in verdict["worker_seconds"].items()})
            return verdict["digest"]
        finally:
            self.seconds["finish"] = time.perf_counter() - self._sent_at
            self._release()

    def _decline(self, reason: str) -> None:
        """An announced push refused by this side: the no-go (a broadcast's header saying so; by ipc, the
        push's end before any bucket) sends every worker back to serving with nothing loaded (the pool
        restarts none); where a header cannot be sent, the push is abandoned."""
        ref, self._armed = self._armed, None
        try:
            info = self.pool._await_begin(ref)
        except Exception:  # the pool refused it too: no worker waits
            self._release()
            return
        try:
            send_no_go(self.plan, info, self._plan_device)
        except Exception as e:
            self._abort(f"{reason}; and the no-go could not be sent: {e!r}")
            return
        try:
            self.pool._end_weight_sync(self.plan.sync_id, error=reason, declined=True)
        except Exception:  # the pool's "abandoned" is expected; the sender raises its own refusal
            pass
        finally:
            self._release()

    def _abort(self, reason: str) -> None:
        try:
            self.pool._end_weight_sync(self.plan.sync_id, error=reason)
        except Exception:
            pass
        finally:
            self._release()

    def _release(self) -> None:
        if self._sender is not None:
            self._sender.release()
        self._sender = self._stage = None
