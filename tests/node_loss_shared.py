"""Losing a node of a running GRPO job on Ray's multi-node test cluster (tests/multinode_shared.py) at a moment the
job's own state says: NodeLoss, a thread that watches the job's rollout pool, picks the node and loses it
(TestCluster.lose). Shared by tests/test_multinode_recovery.py and bench/node_loss.py.

The pool actor's own node is never lost: where that actor runs is the pool's concern, and losing it would be
another failure (the pool's, not a worker's or a rank's)."""
from __future__ import annotations

import contextlib
import threading
import time

from rollout_service.service.client import RolloutClient

from multinode_shared import node_of_actor

LOSS_BOUND_S = 120.0  # the pool's start, the moment to lose a node and the replacement are each waited for at most


def nodes_of(cluster, actors) -> list[str]:
    """The cluster's names of the nodes the actors run on."""
    return [cluster.name_of(node_of_actor(a)) for a in actors]


def all_ready(stats: dict) -> bool:
    return all(w["state"] == "ready" for w in stats["workers"])


def rollouts_in_flight(step: int, requests_per_step: int):
    """when(): the pool has taken every request of the steps before `step` and holds at least half of a step's
    requests in flight, so that every worker has some (the pool sends each request to the least loaded). A
    synchronous job sends a step's requests at once, once the step before it has ended: this is early in
    `step`, or, missed there, in a later one."""
    def when(pool) -> bool:
        stats = pool.stats()
        return (step - 1) * requests_per_step < stats["submitted"] and 2 * stats["in_flight"] >= requests_per_step
    return when


def a_worker_node(cluster):
    """pick(): the node of a rollout worker, other than the pool actor's."""
    def pick(pool, pool_node: str) -> str:
        nodes = nodes_of(cluster, pool.workers())
        apart = [n for n in nodes if n != pool_node]
        assert apart, f"every worker shares the pool actor's node {pool_node}"
        return apart[0]
    return pick


class NodeLoss(threading.Thread):
    """Loses the node `pick(pool, pool_node)` names once `when(pool)` is true, `pool` being the job's rollout
    pool (RolloutClient of `pool_name`) once its workers are ready. Records the node (`victim`, `victim_id`), the
    pool's stats at the loss, when it happened (`lost_at`, time.monotonic()) and, with watch_recovery, the
    seconds until the pool took a worker out of rotation (`seen_s`) and until every worker was ready again
    (`recovered_s`); an exception in `error`."""

    def __init__(self, cluster, pool_name: str, when, pick, watch_recovery: bool = False):
        super().__init__(daemon=True)
        self.cluster, self.pool_name, self.when, self.pick = cluster, pool_name, when, pick
        self.watch_recovery = watch_recovery
        self.victim = self.victim_id = self.stats_at_loss = self.lost_at = self.error = None
        self.seen_s = self.recovered_s = None

    def run(self):
        try:
            deadline = time.monotonic() + LOSS_BOUND_S
            pool = None
            while pool is None or not all_ready(pool.stats()):
                assert time.monotonic() < deadline, f"rollout pool {self.pool_name} never became ready"
                with contextlib.suppress(ValueError):  # not started yet
                    pool = pool or RolloutClient(self.pool_name)
                time.sleep(0.05)
            pool_node = self.cluster.name_of(node_of_actor(pool._pool))
            while not self.when(pool):
                assert time.monotonic() < deadline, "the moment to lose a node never came"
                time.sleep(0.005)
            self.victim = self.pick(pool, pool_node)
            self.victim_id = self.cluster.node_id(self.victim)
            self.stats_at_loss = pool.stats()
            self.lost_at = time.monotonic()
            self.cluster.lose(self.victim)
            if self.watch_recovery:
                self._watch(pool)
        except BaseException as e:  # read by the caller
            self.error = e

    def _watch(self, pool) -> None:
        deadline = time.monotonic() + LOSS_BOUND_S
        while True:  # first out of rotation (the death seen), then ready again (the replacement serving)
            stats = pool.stats()
            if self.seen_s is None and not all_ready(stats):
                self.seen_s = time.monotonic() - self.lost_at
            if any(w["restarts"] for w in stats["workers"]) and all_ready(stats):
                self.recovered_s = time.monotonic() - self.lost_at
                return
            assert time.monotonic() < deadline, f"no replacement ready: {stats['workers']}"
            time.sleep(0.05)
