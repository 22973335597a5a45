"""Deterministic rollout service: the DVR engine, and (lazily, to keep ray optional) the Ray pool."""
from __future__ import annotations

import importlib

import rollout_service.vllm  # noqa: F401  registers the native engine's "vllm" fast path (vLLM is imported on use)

_EXPORTS = {
    "Engine": "rollout_service.engine.engine",
    "SamplingParams": "rollout_service.params",
    "Rollout": "rollout_service.params",
    "RolloutStats": "rollout_service.params",
    "InvalidRequestError": "rollout_service.params",
    "WeightMismatchError": "rollout_service.weights",
    "RolloutWorker": "rollout_service.service.worker",
    "start_pool": "rollout_service.service.pool",
    "RolloutClient": "rollout_service.service.client",
    "CanonicalMismatchError": "kernels.contract",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rollout_service' has no attribute {name!r}")


__all__ = list(_EXPORTS)
