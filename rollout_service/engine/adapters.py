"""The LoRA adapters an engine serves on its one base model, by name.

An adapter is checked whole against the base (rollout_service.lora.check_adapter) and, where the caller
expects one, against the digest of the adapter and the base it was trained on (`push_digest`); only then
does it replace the adapter of that name. A refused adapter leaves every adapter, and the base, as they were.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.lora import LoraWeights
from rollout_service.lora import (AdapterError, LoraAdapter, check_adapter, load_adapter, projection_shapes,
                                  push_digest)
from rollout_service.params import InvalidRequestError


@dataclass(frozen=True)
class AdapterInfo:
    """What a loaded adapter is: its rank, size on the wire and digest (of its tensors alone)."""
    name: str
    r: int
    target_modules: tuple[str, ...]
    nbytes: int
    digest: str


def checked_adapter(name: str, adapter, shapes, max_rank: int | None, expected_digest: str | None,
                    base_digest) -> tuple[LoraAdapter, AdapterInfo]:
    """`adapter` (a LoraAdapter or a PEFT checkpoint directory) checked whole against a base with these
    projection shapes and, where expected_digest is given, push_digest(its digest, base_digest());
    AdapterError otherwise."""
    if not isinstance(name, str) or not name:
        raise AdapterError(f"an adapter name must be a non-empty string, got {name!r}")
    if not isinstance(adapter, LoraAdapter):
        adapter = load_adapter(adapter)
    digest = check_adapter(adapter, shapes, max_rank=max_rank)
    if expected_digest is not None:
        got = push_digest(digest, base_digest())
        if got != expected_digest:
            raise AdapterError(f"adapter {name!r}: digest of adapter + base is {got}, expected {expected_digest} "
                               f"(an adapter trained on other base weights, or changed on the way)")
    return adapter, AdapterInfo(name, adapter.r, adapter.target_modules, adapter.nbytes, digest)


def unknown_adapter(name: str, served) -> AdapterError:
    return AdapterError(f"unknown adapter {name!r}: this engine serves {sorted(served) or 'no adapters'} "
                        "(load one with load_adapter)")


class AdapterTable:
    """name -> the forward's LoraWeights, shared with the engine's runners (ModelRunner.adapters)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_rank: int | None = None):
        self.model, self.device, self.max_rank = model, device, max_rank
        self.weights: dict[str, LoraWeights] = {}
        self.info: dict[str, AdapterInfo] = {}
        self.adapters: dict[str, LoraAdapter] = {}  # as loaded (a restarted peer copies them from here)

    def load(self, name: str, adapter, expected_digest: str | None = None,
             base_digest=None) -> AdapterInfo:
        """Check `adapter` (a LoraAdapter or a PEFT checkpoint directory) and serve it as `name`.
        expected_digest: push_digest(adapter digest, base digest); base_digest() gives the base's."""
        adapter, info = checked_adapter(name, adapter, projection_shapes(self.model), self.max_rank,
                                        expected_digest, base_digest)
        self.weights[name] = adapter.weights(name, self.device)
        self.info[name] = info
        self.adapters[name] = adapter
        return info

    def remove(self, name: str) -> None:
        self._known(name)
        del self.weights[name], self.info[name], self.adapters[name]

    def adapter(self, name: str) -> LoraAdapter:
        """Adapter `name` as it was loaded."""
        self._known(name)
        return self.adapters[name]

    def check_request(self, adapter: str | None) -> None:
        """InvalidRequestError for a request naming an adapter this engine does not serve."""
        if adapter is not None:
            try:
                self._known(adapter)
            except AdapterError as e:
                raise InvalidRequestError(str(e)) from None

    def _known(self, name: str) -> None:
        if name not in self.weights:
            raise unknown_adapter(name, self.weights)
