"""Weight loading with checks, and a content digest the trainer and every worker can compare."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


class WeightMismatchError(ValueError):
    """Weights that are not the expected ones: names or shapes that do not fit the model, non-finite
    values, or a worker whose digest after loading differs from the trainer's."""


def check_state_dict_types(state_dict) -> None:
    """TypeError at the call for anything but a mapping of names to tensors."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"weights must be a state dict (name -> torch.Tensor), got {type(state_dict).__name__}")
    bad = [f"{name!r}: {type(t).__name__}" for name, t in state_dict.items()
           if not isinstance(name, str) or not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"weights must map str names to torch.Tensor values, got {bad[:5]}")


def state_dict_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over names, shapes and the bf16 bytes of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu", torch.bfloat16).contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    return state_dict_digest(dict(model.state_dict()))


def load_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> str:
    """Copy `state_dict` into `model` (all names, exact shapes) and return the model's new digest."""
    check_state_dict_types(state_dict)
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    wrong = sorted(n for n in set(own) & set(state_dict) if tuple(own[n].shape) != tuple(state_dict[n].shape))
    if missing or unexpected or wrong:
        parts = [f"{label}: {names[:5]}{'...' if len(names) > 5 else ''}"
                 for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                 if names]
        raise WeightMismatchError("weights do not fit the model (" + "; ".join(parts) + ")")
    bad = [n for n, t in state_dict.items() if not torch.is_floating_point(t) or not bool(torch.isfinite(t).all())]
    if bad:
        raise WeightMismatchError(f"weights must be finite floating-point tensors: {bad[:5]}")
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(state_dict[name].to(t.device, t.dtype))
    return model_digest(model)
