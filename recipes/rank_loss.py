"""A trainer rank lost (its actor died, e.g. with its node): the rule that tells it from a rank's own error,
and the error that stops the job with where to resume.

FSDP2 ranks are one process group: with a rank gone the others cannot take another collective step, and no
rank can be replaced inside a step (its shards and optimizer state died with it). So the job stops, and the
run continues from its last checkpoint (`python -m recipes.grpo --resume <run_dir>`), on whatever nodes are
left; rollouts and updates are pure functions of (weights, data, seeds), so the resumed steps are the
uninterrupted run's.

A rank Ray cannot reach counts as lost too (ActorUnavailableError, a RayActorError, is how a lost node's rank
first looks): the group cannot take a step without it either.
"""
from __future__ import annotations

import time

# A surviving rank usually fails first: its collective sees the lost peer's socket close before Ray has
# declared that peer's actor dead. Rule: after a rank's own error, the calls still out are awaited this
# long for a rank's death, which makes it a lost rank (TrainerRankLost) rather than that error; ranks whose
# calls are still out then wait in a collective that cannot complete, and are killed.
PEER_DEATH_WAIT_S = 60.0


class TrainerRankLost(RuntimeError):
    """A trainer rank's actor died (its node lost, or its process killed). The job stops; every rank was
    killed; the run continues from its last checkpoint with --resume."""

    def __init__(self, rank: int, node: dict | None, cause: BaseException, run_dir: str | None):
        self.rank, self.node, self.run_dir = rank, node, run_dir
        where = (f"on node {node['node_id']} ({node['ip']})" if node else "before it reported its node")
        resume = (f"python -m recipes.grpo --resume {run_dir}" if run_dir
                  else "python -m recipes.grpo --resume <run_dir>")
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        super().__init__(
            f"trainer rank {rank} {where} was lost ({type(cause).__name__}: {first_line}). The job stopped and "
            f"its other ranks were killed: an FSDP2 process group cannot go on without a rank. Continue the run "
            f"from its last checkpoint, on the nodes left (their trainer.placement may need to change), with\n"
            f"  {resume}")


def gather_ranks(refs: list, nodes: list[dict | None], run_dir: str | None, kill) -> list:
    """ray.get of one call per rank (refs[r] is rank r's). A rank whose actor died raises TrainerRankLost once
    kill() has killed every rank, whatever the other ranks' calls did. A rank's own error is raised as Ray gives
    it, unless a rank dies within PEER_DEATH_WAIT_S of it; ranks whose calls are still out by then are killed
    first (kill())."""
    import ray
    from ray.exceptions import RayActorError

    rank_of = {ref: r for r, ref in enumerate(refs)}
    results, pending, first_error, deadline = [None] * len(refs), list(refs), None, None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:  # no rank died in time: the error was the rank's own; the others wait for that rank
            kill()
            break
        rank = rank_of[ready[0]]
        try:
            results[rank] = ray.get(ready[0])  # each result fetched once (rank 0's may be the full weights)
        except RayActorError as e:
            kill()
            raise TrainerRankLost(rank, nodes[rank] if rank < len(nodes) else None, e, run_dir) from e
        except Exception as e:
            if first_error is None:
                first_error, deadline = e, time.monotonic() + PEER_DEATH_WAIT_S
    if first_error is not None:
        raise first_error
    return results
