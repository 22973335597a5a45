"""Weight checks and loading: a push is checked whole (names, shapes, finite values, the expected
digest) before anything is loaded, then copied into the model in place. The digest itself is
weight_digest's; its names are importable from here too, where callers meet the other weight checks.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from rollout_service.weight_digest import (digest_of_fingerprints, fingerprint_lanes, fingerprints, model_digest,
                                           packed_fingerprints, packed_rows, state_dict_digest, tensor_fingerprint)

__all__ = ["CopyGroup", "WeightMismatchError", "check_finite", "check_fit", "check_state_dict_types",
           "check_weights", "copy_into", "digest_of_fingerprints", "fingerprint_lanes", "fingerprints",
           "load_weights", "model_digest", "packed_fingerprints", "packed_rows", "state_dict_digest",
           "tensor_fingerprint", "weight_spec"]


class WeightMismatchError(ValueError):
    """Weights that are not the expected ones: names or shapes that do not fit the model, non-finite
    values, or a digest other than the expected one."""


def check_state_dict_types(state_dict) -> None:
    """TypeError at the call for anything but a mapping of names to tensors."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"weights must be a state dict (name -> torch.Tensor), got {type(state_dict).__name__}")
    bad = [f"{name!r}: {type(t).__name__}" for name, t in state_dict.items()
           if not isinstance(name, str) or not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"weights must map str names to torch.Tensor values, got {bad[:5]}")


def weight_spec(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor a full push must carry."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_fit(spec: Mapping[str, tuple], shapes: Mapping[str, tuple]) -> None:
    """WeightMismatchError unless `shapes` (name -> shape) has exactly `spec`'s names and shapes."""
    missing = sorted(set(spec) - set(shapes))
    unexpected = sorted(set(shapes) - set(spec))
    wrong = sorted(n for n in set(spec) & set(shapes) if tuple(spec[n]) != tuple(shapes[n]))
    if missing or unexpected or wrong:
        parts = [f"{label}: {names[:5]}{'...' if len(names) > 5 else ''}"
                 for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                 if names]
        raise WeightMismatchError("weights do not fit the model (" + "; ".join(parts) + ")")


def check_finite(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """WeightMismatchError for integer or non-finite tensors (checked on their own device, with one
    wait for each device)."""
    named = list(named)
    bad = [n for n, t in named if not torch.is_floating_point(t)]
    flags = {}
    for n, t in named:
        if torch.is_floating_point(t):
            flags.setdefault(t.device, []).append((n, torch.isfinite(t).all()))
    for pairs in flags.values():
        ok = torch.stack([f for _, f in pairs]).tolist()
        bad += [n for (n, _), good in zip(pairs, ok) if not good]
    if bad:
        raise WeightMismatchError(f"weights must be finite floating-point tensors: {bad[:5]}")


def check_weights(model: torch.nn.Module, state_dict, expected_digest: str | None = None) -> str:
    """Every check a push must pass before anything is loaded; returns the weights' digest."""
    check_state_dict_types(state_dict)
    check_fit(weight_spec(model), {n: tuple(t.shape) for n, t in state_dict.items()})
    check_finite(state_dict.items())
    digest = state_dict_digest(state_dict)
    if expected_digest is not None and digest != expected_digest:
        raise WeightMismatchError(f"the weights' digest is {digest}, expected {expected_digest}")
    return digest


class CopyGroup:
    """Tensor copies issued together by torch._foreach_copy_ (cast and moved as copy_ does: a bf16 cast
    rounds to nearest): a weight push has hundreds of tensors, and a copy_ each costs more host time
    than the copies take. Rules: a group holds its sources until flushed, so `max_bytes` bounds it
    (a source gathered for the copy is freed soon after); a destination added twice flushes the group
    first, so that the later copy lands last."""

    def __init__(self, max_bytes: int | None = None, non_blocking: bool = False):
        self.max_bytes, self.non_blocking = max_bytes, non_blocking
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self._targets: set[int] = set()
        self._bytes = 0

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.data_ptr() in self._targets:  # the same memory (tied weights, a parameter's .data again)
            self.flush()
        self.dst.append(dst)
        self.src.append(src)
        self._targets.add(dst.data_ptr())
        self._bytes += src.numel() * src.element_size()
        if self.max_bytes is not None and self._bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        if self.dst:
            with torch.no_grad():
                torch._foreach_copy_(self.dst, self.src, non_blocking=self.non_blocking)
        self.dst, self.src, self._targets, self._bytes = [], [], set(), 0


def copy_into(model: torch.nn.Module | dict[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy tensors into the model's tensors of the same names (cast and moved as needed); `model` may
    be its state dict, kept by a caller that copies often (state_dict() walks every module)."""
    own = model if isinstance(model, dict) else model.state_dict()
    copies = CopyGroup(non_blocking=True)
    for name, t in named:
        copies.add(own[name], t)
    copies.flush()


def load_weights(model: torch.nn.Module, state_dict, expected_digest: str | None = None) -> str:
    """Check `state_dict` (all names, exact shapes, finite, the expected digest) and only then copy it
    into `model`; returns the digest of what the model now holds."""
    digest = check_weights(model, state_dict, expected_digest)
    copy_into(model, state_dict.items())
    return digest if _holds_bf16(model) else model_digest(model)


def _holds_bf16(model: torch.nn.Module) -> bool:
    """A model whose tensors are all bf16 holds exactly the pushed bits (the digest is of bf16 bits)."""
    return all(t.dtype == torch.bfloat16 for t in model.state_dict().values())
