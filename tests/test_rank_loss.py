"""recipes.rank_loss.gather_ranks over real Ray actors: a rank whose process dies is a lost rank
(TrainerRankLost naming it, its node and --resume, every rank killed), also when a surviving rank's error comes
first; a rank's own error is raised as it is, and ranks left waiting behind it are killed in bounded time."""
from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray")

import recipes.rank_loss as rank_loss  # noqa: E402
from recipes.rank_loss import TrainerRankLost, gather_ranks  # noqa: E402


def _rank_class():
    """A process standing where a trainer rank does: answers, fails on its own, dies, or waits (defined in a
    function, so that Ray ships it by value to workers that cannot import this module)."""
    class Rank:
        def node(self) -> dict:
            return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}

        def answer(self, x, after_s: float = 0.0):
            time.sleep(after_s)
            return x

        def fail(self, after_s: float = 0.0):
            time.sleep(after_s)
            raise RuntimeError("Connection closed by peer")  # what a survivor's collective says

        def die(self, after_s: float = 0.0):
            time.sleep(after_s)
            os._exit(1)
    return Rank


@pytest.fixture
def ranks(local_ray):
    rank = ray.remote(num_cpus=0)(_rank_class())
    actors = [rank.remote() for _ in range(2)]
    nodes = ray.get([a.node.remote() for a in actors])
    yield actors, nodes
    for a in actors:
        ray.kill(a)


class Kills:
    def __init__(self, actors):
        self.actors, self.calls = actors, 0

    def __call__(self):
        self.calls += 1
        for a in self.actors:
            ray.kill(a)


def test_results_in_rank_order(ranks):
    actors, nodes = ranks
    kill = Kills(actors)
    refs = [actors[0].answer.remote("rank 0", 0.3), actors[1].answer.remote("rank 1")]
    assert gather_ranks(refs, nodes, "/runs/a", kill) == ["rank 0", "rank 1"] and kill.calls == 0


def test_a_dead_rank_is_lost_even_after_a_survivors_error(ranks):
    actors, nodes = ranks
    kill = Kills(actors)
    refs = [actors[0].fail.remote(), actors[1].die.remote(0.5)]  # the survivor's error comes first
    with pytest.raises(TrainerRankLost) as lost:
        gather_ranks(refs, nodes, "/runs/a", kill)
    assert lost.value.rank == 1 and lost.value.node == nodes[1] and kill.calls == 1
    message = str(lost.value)
    assert f"trainer rank 1 on node {nodes[1]['node_id']} ({nodes[1]['ip']}) was lost" in message
    assert "python -m recipes.grpo --resume /runs/a" in message


def test_a_ranks_own_error_is_raised_and_ranks_left_waiting_are_killed(ranks, monkeypatch):
    actors, nodes = ranks
    kill = Kills(actors)
    with pytest.raises(ray.exceptions.RayTaskError, match="Connection closed by peer"):
        gather_ranks([actors[0].fail.remote(), actors[1].answer.remote(1)], nodes, None, kill)
    assert kill.calls == 0  # every call answered: nothing to kill
    monkeypatch.setattr(rank_loss, "PEER_DEATH_WAIT_S", 1.0)
    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="Connection closed by peer"):
        gather_ranks([actors[0].fail.remote(), actors[1].answer.remote(1, 3600)], nodes, None, kill)
    assert time.monotonic() - start < 30 and kill.calls == 1
