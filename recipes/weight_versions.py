"""Older weight versions a trainer rank keeps for asynchronous steps: its shards of each, loaded into the
model for a forward, and the log-probs of rollout tokens sampled with them."""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (a view: writing it writes the parameter)."""
    return param.to_local() if hasattr(param, "to_local") else param


def reshard(model: torch.nn.Module) -> None:
    """Drop every unsharded parameter. Rule: before the shards change under FSDP2, since the root
    keeps its all-gathered bf16 parameters after a forward (reshard_after_forward is off for the
    root) and the next forward would reuse them instead of gathering the new shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class WeightVersions:
    """One rank's shards of older weight versions, by version (the pool's weight version after the push
    that carried them)."""

    def __init__(self):
        self._kept: dict[int, list[torch.Tensor]] = {}

    def keep(self, model: torch.nn.Module, version: int, keep: int) -> None:
        """Remember this rank's shards of the model's current weights as `version`; only the newest `keep`
        versions are kept."""
        with torch.no_grad():
            self._kept[version] = [local_shard(p).detach().clone() for p in model.parameters()]
        for old in sorted(self._kept)[:-keep]:
            del self._kept[old]

    @contextlib.contextmanager
    def loaded(self, model: torch.nn.Module, version: int):
        """The model holds `version`'s weights inside the block, its own again after it."""
        if version not in self._kept:
            raise KeyError(f"weight version {version} is not kept (kept: {sorted(self._kept)})")
        params = [local_shard(p) for p in model.parameters()]
        with torch.no_grad():
            own = [p.detach().clone() for p in params]
            reshard(model)
            for p, kept in zip(params, self._kept[version]):
                p.copy_(kept)
        try:
            yield
        finally:
            with torch.no_grad():
                reshard(model)
                for p, mine in zip(params, own):
                    p.copy_(mine)

    def stale_logprobs(self, model: torch.nn.Module, minibatches: list[list[dict]], versions,
                       forward: Callable[[dict], torch.Tensor], device: torch.device) -> dict:
        """{(mini-batch, micro-batch): (log-probs, tokens)}: the tokens of a stale version scored with that
        version's weights over their whole prefix (a rollout switched in flight has tokens of two). Every
        rank runs one forward (`forward`, a micro-batch's log-probs) per micro-batch per version, in step
        (FSDP's gathers pair up), whether or not its own tokens include that version."""
        logps, rows = {}, {}
        for version in versions:
            with self.loaded(model, version), torch.no_grad():
                for m, micros in enumerate(minibatches):
                    for j, mb in enumerate(micros):
                        mine = (mb["weight_version"] == version).to(device)  # [B, T-1] tokens
                        if "rollout_routed_experts" in mb and bool(mine.any()):
                            raise NotImplementedError("routing agreement against an older weight version")
                        logp, key = forward(mb), (m, j)
                        if key in logps:
                            logps[key], rows[key] = torch.where(mine, logp, logps[key]), rows[key] | mine
                        else:
                            logps[key], rows[key] = logp, mine
        return {key: (logps[key], rows[key]) for key in logps}
