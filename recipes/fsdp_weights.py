"""A trainer's full weights out of its FSDP2 shards, one tensor at a time (what a weight push sends)."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


def iter_full_tensors(model: torch.nn.Module, dtype=torch.bfloat16,
                      rename: Callable[[str], str | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per entry of the model's state dict, on its device, cast to `dtype` (None: as
    stored, for a reader that casts as it copies, such as a staged WeightPush.check); an FSDP2 (DTensor)
    shard is gathered one parameter at a time (a collective: every rank must iterate in step).
    rename: the name each entry is sent by, None to leave it out (a LoRA push: recipes.lora.adapter_key)."""
    for name, t in model.state_dict().items():
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        t = whole_tensor(t).detach()
        yield name, t if dtype is None else t.to(dtype)


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a state-dict entry. On a one-rank mesh an FSDP2 shard is the whole
    parameter, so it is taken as it is: full_tensor() there is no copy but still a collective and a
    DTensor dispatch, and a push makes two passes over hundreds of tensors."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.device_mesh.size() == 1:
        local = t.to_local()
        if local.shape == t.shape:
            return local
    return t.full_tensor()
