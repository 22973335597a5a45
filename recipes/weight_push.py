"""A trainer rank's side of the weight push to the rollout pool: the transport kept between pushes, the
push announced as a train step starts, the stage kept between pushes, and a push left sending behind
the next step.

Every rank of the FSDP2 group takes part in every push (the full tensors are gathered collectively,
recipes/fsdp_weights.py); rank 0 alone talks to the pool and sends, through one WeightPush a push
(rollout_service.service.weight_sync). The pool comes as its handle (a RolloutClient), never by name.
"""
from __future__ import annotations

import functools
import threading
import time

import torch
import torch.distributed as dist

from rollout_service.service.weight_sync import SenderStage, WeightPush, stages_whole

from .config import TrainerConfig
from .fsdp_weights import iter_full_tensors
from .lora import adapter_key


class RankWeightPush:
    """One trainer rank's pushes. `full_state_dict` gives rank 0 the bf16 state dict (None on other
    ranks), for the object-store transport."""

    def __init__(self, rank: int, world: int, cfg: TrainerConfig, device: torch.device, model: torch.nn.Module,
                 full_state_dict, adapter: tuple[str, dict, None] | None = None):
        self.rank, self.world, self.cfg, self.device, self.model = rank, world, cfg, device, model
        self._full_state_dict = full_state_dict
        # a LoRA run: (the adapter's name on the pool, its settings, None); a push sends the adapter alone
        self.adapter = adapter
        self._rename = None if adapter is None else adapter_key
        self._sending = None  # rank 0: (thread, push, outcome) of a push still sending (push overlap)
        self._whole_tensors = None  # one rank: the state dict's entries, kept between pushes (_stage_sources)
        self._transport = None  # (the pool, the transport chosen for it), kept between pushes: see _push_for
        self._armed = None  # rank 0: (the pool, its WeightPush) of a push announced by arm()
        # rank 0: guards _armed, which the train step's thread and the arm's expiry timer both take
        self._armed_lock = threading.Lock()
        self._arm_timer: threading.Timer | None = None
        self._stage = SenderStage()  # rank 0: a staged push's buffer (and by ipc its handle), kept between pushes

    def arm(self, pool) -> None:
        """Rank 0 announces the next push to `pool` (WeightPush.announce) when it will go by broadcast or
        ipc, the transport it kept from the last push to this pool (trainer.weight_push.arm)."""
        kept = self._transport
        if self.rank != 0 or not self.cfg.weight_push.arm or kept is None or kept[0] != pool \
                or kept[1] == "object_store":
            return
        self.decline_armed("another push was armed")  # one armed at a time
        push = self._new_push(pool, kept[1])
        push.announce(self._state_shapes, self.device, stages_whole(self._state_numel, self._stage_bytes))
        with self._armed_lock:
            self._armed = (pool, push)
        # Rule: the workers wait for an armed push through the step, and give it up at the push's
        # timeout (restarting); a step that outlasts half of it has its push declined first, and the
        # push after it goes unarmed, with the whole timeout of its own
        self._arm_timer = threading.Timer(self.cfg.weight_push.timeout_s / 2, self._expire_arm, args=(push,))
        self._arm_timer.daemon = True
        self._arm_timer.start()

    def _expire_arm(self, push: WeightPush) -> None:
        with self._armed_lock:
            if self._armed is None or self._armed[1] is not push:
                return  # taken by the push, or declined, before the timer ran
            self._armed = None
            push.cancel(f"the train step outlasted half of the push's {self.cfg.weight_push.timeout_s:g} s "
                        "timeout; the push follows unarmed")

    def _take_armed(self):
        """The armed (pool, push), now no longer armed here; None if none is."""
        with self._armed_lock:
            armed, self._armed = self._armed, None
        if self._arm_timer is not None:
            self._arm_timer.cancel()
            self._arm_timer = None
        return armed

    def wake_engines(self) -> None:
        """Rank 0, an armed ipc push: the workers' engines are asked to wake now (WeightPush.wake), called
        once the step's last backward has run. Rule: the activations the engines slept for are freed by
        then; what is left of the step (the clip, the optimizer step) runs while they map their memory
        back, instead of the push's first load waiting for it."""
        with self._armed_lock:
            if self._armed is not None:
                self._armed[1].wake()

    def decline_armed(self, reason: str) -> None:
        """An armed push that will not follow: its workers go back to serving."""
        armed = self._take_armed()
        if armed is not None:
            armed[1].cancel(reason)

    def forget_sources(self) -> None:
        """The parameters were replaced (a checkpoint load): the kept list of them is dropped."""
        self._whole_tensors = None

    def push(self, pool, overlap: bool = False) -> dict | None:
        """TrainerRank.push_weights: load the weights into the rollout pool `pool`; rank 0's report."""
        if self._sending is not None:
            raise RuntimeError("the last weight push is still sending: finish_push() first")
        start = time.perf_counter()
        push, transport = self._push_for(pool, overlap)
        connected = time.perf_counter()
        if transport == "object_store":
            sd = self._full_state_dict()
            if sd is None:
                return None
            pool_digest = push.load(sd)
            phases, staged, sending, pool_version = {}, None, False, None
        else:
            phases, staged, pool_digest = self._push_bucketed(push, overlap)
            if push is None:
                return None
            pool_version, sending = push.plan.version, self._sending is not None
        return {"digest": push.digest, "pool_digest": pool_digest, "transport": transport, "staged": staged,
                "sending": sending, "pool_version": pool_version,
                "seconds": time.perf_counter() - start, "phases": {"connect": connected - start, **phases}}

    def finish(self) -> dict | None:
        """TrainerRank.finish_push: the verdict of a push left sending, once it has landed."""
        if self._sending is None:
            return None
        thread, push, outcome = self._sending
        start = time.perf_counter()
        thread.join()
        self._sending = None
        if "error" in outcome:
            raise outcome["error"]
        return {"digest": push.digest, "pool_digest": outcome["digest"], "wait": time.perf_counter() - start,
                "behind": {k: push.seconds[k] for k in ("send", "finish") if k in push.seconds}}

    def _push_for(self, pool, overlap: bool) -> tuple:
        """(rank 0's WeightPush, None on other ranks; the transport). The transport is kept between pushes
        to the same pool: rank 0's first push to it resolves the configured one (WeightPush: "auto") and
        every rank learns it. Rule: every rank keeps or drops the transport together (choosing it is a
        collective), so it is dropped only where every rank sees the failure: a push refused before
        sending, as an ipc push is once a worker has moved off the sender's GPU."""
        kept = self._transport[1] if self._transport is not None and self._transport[0] == pool else None
        push = None
        if self.rank == 0:
            configured = self.cfg.weight_push.transport
            push = self._armed_push(pool, kept, overlap) or self._new_push(pool, kept or configured)
        if kept is None:
            choice = [None if push is None else push.transport]
            if self.world > 1:
                dist.broadcast_object_list(choice, src=0)
            self._transport = (pool, choice[0])
        return push, self._transport[1]

    def _new_push(self, pool, transport: str) -> WeightPush:
        return WeightPush(pool, transport, self.device, bucket_bytes=self.cfg.weight_push.bucket_mb << 20,
                          stage_bytes=self._stage_bytes, timeout_s=self.cfg.weight_push.timeout_s,
                          stage=self._stage, mode=self.cfg.weight_push.switch, adapter=self.adapter)

    def _armed_push(self, pool, transport: str | None, overlap: bool) -> WeightPush | None:
        """Rank 0's armed push, when it fits this one (its pool and transport, a push not left sending);
        one that does not is declined."""
        armed = self._take_armed()
        if armed is None:
            return None
        armed_pool, push = armed
        if armed_pool == pool and transport == push.transport and not overlap:
            return push
        push.cancel("the push it was armed for went another way")
        return None

    @property
    def _stage_bytes(self) -> int:
        return self.cfg.weight_push.stage_mb << 20

    @functools.cached_property
    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every pushed entry's global shape, in the order a push sends them (iter_full_tensors)."""
        return {self._name(name): tuple(t.shape) for name, t in self.model.state_dict().items()
                if self._name(name) is not None}

    def _name(self, name: str) -> str | None:
        return name if self._rename is None else self._rename(name)

    @functools.cached_property
    def _state_numel(self) -> int:
        """Elements in the model's state dict, by global shapes (every rank agrees). Shapes never change,
        and an FSDP2 state_dict() walks every module and wraps every shard (milliseconds a push)."""
        return sum(t.numel() for name, t in self.model.state_dict().items() if self._name(name) is not None)

    def _stage_sources(self):
        """What a staged push copies: iter_full_tensors as stored (the stage casts). On one rank every
        entry is the parameter's own storage (no gather), so that list is kept between pushes: walking
        an FSDP2 state_dict() wraps each shard in a DTensor, host time every push. Rule: the list stays
        valid because parameters are only ever updated in place (optimizer steps,
        TrainerRank._weights_of, checkpoint loads); a load drops it all the same."""
        if self.world > 1:
            return iter_full_tensors(self.model, None, self._rename)
        if self._whole_tensors is None:
            self._whole_tensors = list(iter_full_tensors(self.model, None, self._rename))
        return iter(self._whole_tensors)

    def _push_bucketed(self, push: WeightPush | None, overlap: bool = False):
        """(the seconds of each phase: check, begin, send, finish; whether the push was staged; the digest
        the pool holds, None while the push is sending or on other ranks than 0). Staged (stages_whole)
        the weights are gathered once; streamed, once to check and once to send. Every rank takes part
        in every gather, in step. With `overlap` a staged push is left sending in a thread (finish)."""
        staged = stages_whole(self._state_numel, self._stage_bytes)
        verdict = [None]
        start = time.perf_counter()
        try:
            # staged: the stage casts the float32 master weights as it copies them
            tensors = self._stage_sources() if staged else iter_full_tensors(self.model, rename=self._rename)
            if push is None:
                for _ in tensors:
                    pass
            else:  # refused: an armed push's no-go has released its waiting workers
                push.check(tensors, self._state_numel if staged else None)
                checked = time.perf_counter() - push.seconds["begin"]
        except Exception as e:  # refused before anything was sent: every rank stops here
            verdict[0] = e
        if self.world > 1:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            self._transport = None  # every rank drops it here (see _push_for)
            raise verdict[0]
        tensors = None if staged else iter_full_tensors(self.model, rename=self._rename)
        if push is None:
            for _ in tensors or ():  # the gathers rank 0 sends from
                pass
            return {}, staged, None
        phases = {"check": checked - start, **push.seconds}  # before a sending thread adds its own
        if overlap and staged:
            outcome: dict = {}

            def send():
                try:
                    outcome["digest"] = push.send()
                except BaseException as e:  # raised by finish
                    outcome["error"] = e
            thread = threading.Thread(target=send, name="weight-push", daemon=True)
            thread.start()
            self._sending = (thread, push, outcome)
            return phases, staged, None
        digest = push.send(tensors)
        return {**phases, **push.seconds}, staged, digest
