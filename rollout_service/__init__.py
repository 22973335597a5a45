"""Deterministic rollout service: the DVR engine, and (lazily, to keep ray optional) the Ray pool."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": ".engine",
    "SamplingParams": ".params",
    "Rollout": ".params",
    "RolloutStats": ".params",
    "InvalidRequestError": ".params",
    "WeightMismatchError": ".weights",
    "RolloutWorker": ".worker",
    "RolloutPool": ".pool",
    "RolloutClient": ".client",
    "WeightSyncError": ".client",
    "CanonicalMismatchError": ".client",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'rollout_service' has no attribute {name!r}")


__all__ = list(_EXPORTS)
