"""What a request ends with when no engine finishes it (an error, an abort), and the cancels that
arrive before their request: shared by the pool and its workers."""
from __future__ import annotations

import time

from rollout_service.params import Rollout


def error_rollout(prompt, message: str) -> Rollout:
    prompt = list(prompt) if isinstance(prompt, (list, tuple)) else []
    return Rollout(prompt_token_ids=prompt, finish_reason="error", error=message)


def abort_rollout(prompt) -> Rollout:
    prompt = list(prompt) if isinstance(prompt, (list, tuple)) else []
    return Rollout(prompt_token_ids=prompt, finish_reason="abort")


class EarlyCancels:
    """Cancels that arrived before their request (Ray may deliver calls to an async actor out of
    order). They expire after `ttl` seconds, so a cancel that raced a finishing request does not
    hit a later request that reuses its id."""

    def __init__(self, ttl: float = 10.0):
        self.ttl = ttl
        self._keys: dict[str, float] = {}

    def add(self, key: str) -> None:
        now = time.monotonic()
        if len(self._keys) > 1024:
            self._keys = {k: t for k, t in self._keys.items() if t > now}
        self._keys[key] = now + self.ttl

    def pop(self, key: str) -> bool:
        deadline = self._keys.pop(key, None)
        return deadline is not None and deadline > time.monotonic()
