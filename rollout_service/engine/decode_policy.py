"""How `verified` requests decode: propose-and-verify (DVR) or canonical steps.

Both commit the same tokens and log-probs (the canonical ones), so the choice changes speed only.
DVR pays a verify window per W proposals plus the rejected tails; canonical steps pay the canonical
kernels on every step. Which is cheaper depends on the model, the device and the batch size (the
canonical kernels are close to cuBLAS at decode-sized M), so `auto` measures both per batch-size
bucket and keeps the faster one, trying the other again now and then as contexts grow. Each retry
that leaves the leader in place doubles the wait before the next (up to `max_backoff` times
`retry_every`), so a clear winner pays for few retries; a change of leader starts over. A new bucket
next to a measured one starts with that bucket's leader and runs the other strategy only at its
retries: the batch sizes met while requests are admitted or finish then cost no full exploration each.

A rate is committed tokens over seconds across a strategy's last `history` timed steps at a bucket,
leaving out steps that took more than `outlier` times the typical (lower median) step: a one-off stall
(a compile, a graph capture, an allocator grow, a collection pause) would otherwise hand the lead to
the slower strategy until the next retry.
"""
from __future__ import annotations

from collections import Counter, deque

# The engine setting: measure and keep the faster strategy, or always DVR. Always-canonical steps are
# not a setting: that is the request mode `invariant` (one way to ask for it).
VERIFIED_DECODE = ("auto", "dvr")
STRATEGIES = ("dvr", "canonical")


class DecodePolicy:
    def __init__(self, mode: str = "auto", retry_every: int = 16, explore: int = 2, max_backoff: int = 8,
                 history: int = 8, outlier: float = 3.0):
        if mode not in VERIFIED_DECODE + STRATEGIES:  # a fixed strategy: tests and benchmarks
            raise ValueError(f"verified_decode must be one of {VERIFIED_DECODE}, got {mode!r}")
        if explore < 1:  # a strategy's first step is not timed: a rate needs at least one more
            raise ValueError(f"explore must be >= 1 timed steps, got {explore}")
        self.mode, self.retry_every, self.explore, self.max_backoff = mode, retry_every, explore, max_backoff
        self.history, self.outlier = history, outlier
        # (bucket, strategy) -> recent timed steps as (committed tokens, seconds): a ratio of sums, which
        # a step with an early rollback (few tokens) cannot swing the way a mean of rates would
        self._steps: dict[tuple[int, str], deque] = {}
        self._samples: Counter = Counter()  # (bucket, strategy) -> decode steps seen
        self._since_retry: Counter = Counter()  # bucket -> choices since the last retry
        self._interval: dict[int, int] = {}  # bucket -> choices between retries now
        self._leader: dict[int, str] = {}  # bucket -> the faster strategy at the last choice

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()  # next power of two

    def choose(self, batch: int) -> str:
        if self.mode != "auto":
            return self.mode
        b = self.bucket(batch)
        explored = [s for s in STRATEGIES if self._samples[(b, s)] > self.explore]
        if len(explored) < 2:
            lead = self._nearest_leader(b)
            if lead is None:  # nothing measured nearby: each strategy until it has `explore` timed steps
                return next(s for s in STRATEGIES if s not in explored)
            if not explored:
                return lead
            # the strategy measured here leads until the other one, run at retries, beats it
            best, other = explored[0], next(s for s in STRATEGIES if s not in explored)
        else:
            best, other = sorted(STRATEGIES, key=lambda s: -self._rate((b, s)))
        if self._leader.get(b) != best:  # first choice here, or the other strategy took the lead
            self._leader[b], self._interval[b], self._since_retry[b] = best, self.retry_every, 0
        self._since_retry[b] += 1
        if self._since_retry[b] < self._interval[b]:
            return best
        self._since_retry[b] = 0
        self._interval[b] = min(2 * self._interval[b], self.max_backoff * self.retry_every)
        return other

    def _nearest_leader(self, b: int) -> str | None:
        """The faster strategy in the nearest other bucket (the larger on a tie) where both are measured."""
        measured = {k for k, _ in self._steps
                    if k != b and all(self._samples[(k, s)] > self.explore for s in STRATEGIES)}
        if not measured:
            return None
        near = min(measured, key=lambda k: (abs(k.bit_length() - b.bit_length()), -k))
        return max(STRATEGIES, key=lambda s: self._rate((near, s)))

    def record(self, batch: int, strategy: str, tokens: int, seconds: float) -> None:
        """A decode step of `batch` verified requests under `strategy` committed `tokens` in `seconds`."""
        if self.mode != "auto" or seconds <= 0:
            return
        key = (self.bucket(batch), strategy)
        self._samples[key] += 1
        if self._samples[key] == 1:
            return  # a strategy's first step at a size pays kernel compiles and graph captures
        self._steps.setdefault(key, deque(maxlen=self.history)).append((tokens, seconds))

    def _rate(self, key) -> float:
        steps = self._steps[key]
        typical = sorted(s for _, s in steps)[(len(steps) - 1) // 2]  # lower median: two steps give the faster
        kept = [(t, s) for t, s in steps if s <= self.outlier * typical]
        return sum(t for t, _ in kept) / sum(s for _, s in kept)

    def rates(self) -> dict[str, float]:
        """Measured committed tokens/s, keyed 'strategy@bucket' (for logs and benchmarks)."""
        return {f"{s}@{b}": round(self._rate((b, s)), 1) for b, s in sorted(self._steps)}
