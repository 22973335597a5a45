"""The process groups of broadcast pushes: the sender (rank 0, which hosts the store) and every
worker. Rule: a group is kept by every side between pushes while the pool's workers and the sender
stay the same (set up once, like NCCL communicators in every RL framework); the pool decides when a
push needs a new one (BroadcastGroups) and names the groups each side drops."""
from __future__ import annotations

import datetime
import uuid

from .plan import SyncPlan

# This process's ID as a sender, and its broadcast groups by group id: (store, process group)
PROCESS_ID = uuid.uuid4().hex
SENDER_GROUPS: dict[str, tuple] = {}


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


def host_and_free_port() -> tuple[str, int]:
    """Where this process (a sender) hosts a new group's store."""
    import socket
    try:
        import ray
        host = ray.util.get_node_ip_address()
    except Exception:
        host = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


class BroadcastGroups:
    """The pool's record of its last broadcast group, and of the groups given up since (which the next
    sender of a new group drops)."""

    def __init__(self):
        self._last = None  # (group id, sender id, members, store, timeout)
        self._dropped: list[str] = []

    def assign(self, plan: SyncPlan, members: tuple[str, ...]) -> None:
        """The last group when its members (the sender's process, these workers in this order) and its
        timeout are the same, else a new one at the sender's store. Rule: a group's operations time out
        after the timeout it was made with (join_group), so a push with another timeout_s needs a group
        of its own to be held to it."""
        last = self._last
        if last is not None and last[1:3] == (plan.sender_id, members) and last[4] == plan.timeout_s:
            plan.group_id, plan.new_group = last[0], False
            plan.store_host, plan.store_port = last[3]
        else:
            self.forget()
            plan.group_id, plan.new_group = uuid.uuid4().hex[:12], True
            self._last = (plan.group_id, plan.sender_id, members, (plan.store_host, plan.store_port), plan.timeout_s)

    def forget(self) -> None:
        """The last group is not used again (a member failed mid-push, or a push failed to begin)."""
        if self._last is not None:
            self._dropped.append(self._last[0])
            self._last = None

    def replaced_by(self, plan: SyncPlan) -> list[str]:
        """The groups a push's sender drops: those given up since, when the push sets up a new group."""
        if not plan.new_group:
            return []
        dropped, self._dropped = self._dropped, []
        return dropped
