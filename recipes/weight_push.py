"""A trainer rank's side of the weight push to the rollout pool: the pool's client and the transport
kept between pushes, the push armed as a train step starts, the stage kept between pushes, and a push
left sending behind the next step.

Every rank of the FSDP2 group takes part in every push (the full tensors are gathered collectively);
rank 0 alone talks to the pool and sends (rollout_service.service.weight_sync.WeightSender).
"""
from __future__ import annotations

import functools
import threading
import time

import torch
import torch.distributed as dist

from rollout_service.service.weight_sync import (SenderStage, WeightSender, choose_transport,
                                                 fingerprint_entries, iter_full_tensors, stages_whole)
from rollout_service.weights import state_dict_digest

from .config import TrainerConfig


class RankWeightPush:
    """One trainer rank's pushes. `full_state_dict` gives rank 0 the bf16 state dict (None on other
    ranks), for the object-store transport."""

    def __init__(self, rank: int, world: int, cfg: TrainerConfig, device: torch.device, model: torch.nn.Module,
                 full_state_dict):
        self.rank, self.world, self.cfg, self.device, self.model = rank, world, cfg, device, model
        self._full_state_dict = full_state_dict
        self._sending = None  # rank 0: (thread, sender, outcome) of a push still sending (push overlap)
        self._whole_tensors = None  # one rank: the state dict's entries, kept between pushes (_stage_sources)
        self._pool_link = None  # ((pool name, namespace), the transport), kept between pushes: see _link
        self._pool_client = None  # rank 0: ((pool name, namespace), its client), kept likewise
        self._armed = None  # rank 0: ((pool name, namespace), its sender) of a push armed by arm()
        # rank 0: guards _armed, which the train step's thread and the arm's expiry timer both take
        self._armed_lock = threading.Lock()
        self._arm_timer: threading.Timer | None = None
        self._stage = SenderStage()  # rank 0: a staged push's buffer (and by ipc its handle), kept between pushes

    def arm(self, pool_name: str, namespace: str) -> None:
        """Rank 0 arms the next push (WeightSender.arm) when it will go by broadcast or ipc, the transport
        it kept from the last push to this pool (trainer.arm_weight_push)."""
        key = (pool_name, namespace)
        link, client = self._pool_link, self._pool_client
        if (self.rank != 0 or not self.cfg.arm_weight_push or link is None or link[0] != key
                or link[1] == "object_store" or client is None or client[0] != key):
            return
        self.decline_armed("another push was armed")  # one armed at a time
        sender = self._sender(client[1], link[1])
        staged = stages_whole(self._state_numel, self.cfg.weight_stage_mb << 20)
        sender.arm(self._state_shapes, self.device, staged)
        with self._armed_lock:
            self._armed = (key, sender)
        # Rule: the workers wait for an armed push through the step, and give it up at the push's
        # timeout (restarting); a step that outlasts half of it has its push declined first, and the
        # push after it goes unarmed, with the whole timeout of its own
        self._arm_timer = threading.Timer(self.cfg.weight_push_timeout_s / 2, self._expire_arm, args=(sender,))
        self._arm_timer.daemon = True
        self._arm_timer.start()

    def _expire_arm(self, sender: WeightSender) -> None:
        with self._armed_lock:
            if self._armed is None or self._armed[1] is not sender:
                return  # taken by the push, or declined, before the timer ran
            self._armed = None
            sender.decline(f"the train step outlasted half of the push's {self.cfg.weight_push_timeout_s:g} s "
                           "timeout; the push follows unarmed")

    def _take_armed(self):
        """The armed ((pool name, namespace), sender), now no longer armed here; None if none is."""
        with self._armed_lock:
            armed, self._armed = self._armed, None
        if self._arm_timer is not None:
            self._arm_timer.cancel()
            self._arm_timer = None
        return armed

    def wake_engines(self) -> None:
        """Rank 0, an armed ipc push: the workers' engines are asked to wake now (WeightSender.wake_workers),
        called once the step's last backward has run. Rule: the activations the engines slept for are
        freed by then; what is left of the step (the clip, the optimizer step) runs while they map
        their memory back, instead of the push's first load waiting for it."""
        with self._armed_lock:
            if self._armed is not None:
                self._armed[1].wake_workers()

    def decline_armed(self, reason: str) -> None:
        """An armed push that will not follow: its workers go back to serving."""
        armed = self._take_armed()
        if armed is not None:
            armed[1].decline(reason)

    def forget_sources(self) -> None:
        """The parameters were replaced (a checkpoint load): the kept list of them is dropped."""
        self._whole_tensors = None

    def push(self, pool_name: str, namespace: str, overlap: bool = False) -> dict | None:
        """TrainerRank.push_weights: load the weights into the rollout pool; rank 0's report."""
        if self._sending is not None:
            raise RuntimeError("the last weight push is still sending: finish_push() first")
        start = time.perf_counter()
        client, transport = self._link(pool_name, namespace)
        connected = time.perf_counter()
        pool_version = None
        try:
            if transport == "object_store":
                sd = self._full_state_dict()
                if sd is None:
                    return None
                digest = state_dict_digest(sd)
                pool_digest = client.update_weights(sd, expected_digest=digest, mode=self.cfg.weight_switch)
                phases, staged, sending = {}, None, False
            else:
                sender, phases, staged, pool_digest = self._push_bucketed(client, transport, overlap)
                if sender is None:
                    return None
                digest, pool_version, sending = sender.plan.digest, sender.plan.version, self._sending is not None
        except BaseException:
            self._pool_client = None  # see _link
            raise
        return {"digest": digest, "pool_digest": pool_digest, "transport": transport, "staged": staged,
                "sending": sending, "pool_version": pool_version,
                "seconds": time.perf_counter() - start, "phases": {"connect": connected - start, **phases}}

    def finish(self) -> dict | None:
        """TrainerRank.finish_push: the verdict of a push left sending, once it has landed."""
        if self._sending is None:
            return None
        thread, sender, outcome = self._sending
        start = time.perf_counter()
        thread.join()
        self._sending = None
        if "error" in outcome:
            self._pool_client = None  # see _link
            raise outcome["error"]
        return {"digest": sender.plan.digest, "pool_digest": outcome["digest"], "wait": time.perf_counter() - start,
                "behind": {k: sender.seconds[k] for k in ("send", "finish") if k in sender.seconds}}

    def _link(self, pool_name: str, namespace: str) -> tuple:
        """(rank 0's client of the pool, or None; the transport), both kept between pushes to the same
        pool. Rank 0 drops its client after any failed push (a pool restarted under the same name has a
        new handle). Rule: every rank keeps or drops the transport together (choosing it is a
        collective), so it is dropped only where every rank sees the failure: a push refused before
        sending, as an ipc push is once a worker has moved off the sender's GPU."""
        from rollout_service import RolloutClient  # imports ray

        key = (pool_name, namespace)
        if self.rank == 0 and (self._pool_client is None or self._pool_client[0] != key):
            self._pool_client = (key, RolloutClient(pool_name, namespace=namespace))
        client = self._pool_client[1] if self.rank == 0 else None
        if self._pool_link is None or self._pool_link[0] != key:
            self._pool_link = (key, self._transport(client))
        return client, self._pool_link[1]

    def _transport(self, client) -> str:
        """The configured transport, "auto" resolved on rank 0 and shared with every rank."""
        choice = [None]
        if self.rank == 0:
            gpus = [w["gpu"] for w in client.stats()["workers"]]
            choice[0] = choose_transport(self.cfg.weight_sync, self.device, gpus)
        if self.world > 1:
            dist.broadcast_object_list(choice, src=0)
        return choice[0]

    @functools.cached_property
    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every state-dict entry's global shape, in the order a push sends them (iter_full_tensors)."""
        return {name: tuple(t.shape) for name, t in self.model.state_dict().items()}

    @functools.cached_property
    def _state_numel(self) -> int:
        """Elements in the model's state dict, by global shapes (every rank agrees). Shapes never change,
        and an FSDP2 state_dict() walks every module and wraps every shard (milliseconds a push)."""
        return sum(t.numel() for t in self.model.state_dict().values())

    def _stage_sources(self):
        """What a staged push copies: iter_full_tensors as stored (the stage casts). On one rank every
        entry is the parameter's own storage (no gather), so that list is kept between pushes: walking
        an FSDP2 state_dict() wraps each shard in a DTensor, about 20 ms of host time a push at 1.5B
        parameters. Rule: the list stays valid because parameters are only ever updated in place
        (optimizer steps, TrainerRank._weights_of, checkpoint loads); a load drops it all the same."""
        if self.world > 1:
            return iter_full_tensors(self.model, None)
        if self._whole_tensors is None:
            self._whole_tensors = list(iter_full_tensors(self.model, None))
        return iter(self._whole_tensors)

    def _push_bucketed(self, client, transport: str, overlap: bool = False):
        """(rank 0's sender, or None on other ranks; the seconds of each phase: check, begin, send, finish;
        whether the push was staged; the digest the pool holds, None while the push is sending). Staged
        (weight_sync.stages_whole) the weights are gathered once; streamed, once to check and once to
        send. Every rank takes part in every gather, in step. With `overlap` a staged push is left
        sending in a thread (finish)."""
        sender = self._armed_sender(client, transport, overlap)
        if self.rank == 0 and sender is None:
            sender = self._sender(client, transport)
        staged = stages_whole(self._state_numel, self.cfg.weight_stage_mb << 20)
        verdict = [None]
        start = time.perf_counter()
        try:
            # staged: the stage casts the float32 master weights as it copies them
            tensors = self._stage_sources() if staged else iter_full_tensors(self.model)
            if sender is None:
                for _ in tensors:
                    pass
            else:
                entries = sender.stage(tensors, self._state_numel) if staged \
                    else fingerprint_entries(tensors, sender.bucket_bytes)
                checked = time.perf_counter()
                sender.begin(entries)
        except Exception as e:  # refused before anything was sent: every rank stops here
            verdict[0] = e
            if sender is not None and sender.armed:  # the header's no-go releases the waiting workers
                sender.decline(f"the sender's checks refused the push: {e}")
        if self.world > 1:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            self._pool_link = None  # every rank drops it here (see _link)
            raise verdict[0]
        tensors = None if staged else iter_full_tensors(self.model)
        if sender is None:
            for _ in tensors or ():  # the gathers rank 0 sends from
                pass
            return None, {}, staged, None
        phases = {"check": checked - start, **sender.seconds}  # before a sending thread adds its own
        if overlap and staged:
            outcome: dict = {}

            def send():
                try:
                    outcome["digest"] = sender.complete()
                except BaseException as e:  # raised by finish
                    outcome["error"] = e
            thread = threading.Thread(target=send, name="weight-push", daemon=True)
            thread.start()
            self._sending = (thread, sender, outcome)
            return sender, phases, staged, None
        digest = sender.complete(tensors)
        return sender, {**phases, **sender.seconds}, staged, digest

    def _sender(self, client, transport: str) -> WeightSender:
        return WeightSender(client, transport, self.cfg.weight_bucket_mb << 20, stage=self._stage,
                            timeout_s=self.cfg.weight_push_timeout_s)

    def _armed_sender(self, client, transport: str, overlap: bool):
        """Rank 0's armed sender, when it fits this push (its pool and transport, a push not left
        sending); one that does not is declined."""
        armed = self._take_armed()
        if armed is None:
            return None
        key, sender = armed
        if client is not None and key == self._pool_client[0] and transport == sender.transport and not overlap:
            return sender
        sender.decline("the push it was armed for went another way")
        return None
