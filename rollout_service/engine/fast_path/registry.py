"""Fast paths by name: what a string EngineConfig.fast_path selects besides the engine's own "native".

A package that offers a fast path registers a factory for it (rollout_service.vllm registers "vllm"
when imported, which `import rollout_service` does), so the engine names no package above it.
"""
from __future__ import annotations

from collections.abc import Callable

# name -> factory(model, **fast_path_options) -> a FastPath (engine.fast_path.base) on `model`
_FACTORIES: dict[str, Callable] = {}


def register_fast_path(name: str, factory: Callable) -> None:
    """Make `name` a fast_path choice; factory(model, **options) builds it on the engine's model."""
    _FACTORIES[name] = factory


def fast_path_factory(name: str) -> Callable:
    """The registered factory of `name`; ValueError naming the choices otherwise."""
    if name not in _FACTORIES:
        choices = ", ".join(repr(n) for n in ("native", *sorted(_FACTORIES)))
        raise ValueError(f"unknown fast_path {name!r}: use {choices} or a FastPath object")
    return _FACTORIES[name]
