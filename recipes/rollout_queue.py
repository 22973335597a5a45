"""Each step's rollout batch, generated when the step asks for it or ahead of it (train.async_steps)."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable


@dataclass
class RolloutBatch:
    rows: list[dict]  # the task's rows of the step's prompts
    prompts: list[list[int]]  # the requests' prompts (each row's, rollout.n times)
    rollouts: list  # Rollout per request, in request order
    seconds: float  # generating the batch, from its requests' submission to its last rollout


class RolloutQueue:
    """The rollout batch of each step, from generate(step) -> (rows, prompts, rollouts).

    ahead = 0: generated when asked, on the caller's thread (the synchronous recipe). ahead = k > 0:
    asking for step s also starts steps s+1 .. s+k, generated one after another on a background
    thread while the caller trains; each request runs on the weights the pool holds when it is
    dispatched, which its rollout's weight_versions record.
    """

    def __init__(self, generate: Callable[[int], tuple], last_step: int, ahead: int = 0):
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        self._generate, self._last, self.ahead = generate, last_step, ahead
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollouts") if ahead else None
        self._pending: dict[int, Future] = {}

    def get(self, step: int) -> tuple[RolloutBatch, float]:
        """(step's batch, seconds the caller waited for it)."""
        start = time.perf_counter()
        if self._executor is None:
            batch = self._timed(step)
        else:
            for s in range(step, min(step + self.ahead, self._last) + 1):
                if s not in self._pending:
                    self._pending[s] = self._executor.submit(self._timed, s)
            batch = self._pending.pop(step).result()
        return batch, time.perf_counter() - start

    def _timed(self, step: int) -> RolloutBatch:
        start = time.perf_counter()
        rows, prompts, rollouts = self._generate(step)
        return RolloutBatch(rows, prompts, rollouts, time.perf_counter() - start)

    def close(self) -> None:
        """Drops the batches not yet asked for (one being generated finishes on its own)."""
        if self._executor is not None:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()
            self._executor.shutdown(wait=False, cancel_futures=True)
