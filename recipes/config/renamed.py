"""Keys that moved, read at their new place for one release. Rule: an old key in a config file or an
override still works and says once, on stderr, which key replaces it; a config that sets a key both ways
is refused, since which of the two values it meant is not known.

    trainer.lr=2e-3        ->  trainer.optimizer.lr=2e-3, and a ConfigKeyDeprecated warning
"""
from __future__ import annotations

import warnings

from .errors import ConfigError

_SECTIONS = {
    "placement": {"resources_per_rank": "resources_per_rank", "placement_strategy": "strategy",
                  "torch_threads": "torch_threads"},
    "optimizer": {k: k for k in ("lr", "betas", "weight_decay", "max_grad_norm")},
    "loss": {k: k for k in ("clip_low", "clip_high", "old_logprobs", "scale_advantages")},
    "batching": {k: k for k in ("mini_batches", "micro_batch_size", "max_tokens_per_micro_batch", "packing",
                                "activation_checkpointing")},
    "weight_push": {"weight_sync": "transport", "weight_bucket_mb": "bucket_mb", "weight_stage_mb": "stage_mb",
                    "weight_switch": "switch", "weight_push_timeout_s": "timeout_s", "arm_weight_push": "arm"},
}
# old dotted key -> new dotted key
RENAMED_KEYS = {f"trainer.{old}": f"trainer.{section}.{new}"
                for section, names in _SECTIONS.items() for old, new in names.items()}


class ConfigKeyDeprecated(DeprecationWarning):
    """A config key that moved; its message names the key to use."""


# DeprecationWarning is hidden by default outside __main__; these are meant for whoever runs a recipe
warnings.filterwarnings("default", category=ConfigKeyDeprecated)


def _warn(old: str, new: str, where: str) -> None:
    warnings.warn(f"{where}{old} is deprecated and will be removed in the next release; use {new}",
                  ConfigKeyDeprecated, stacklevel=4)


def renamed_override_key(key: str) -> str:
    """An override's dotted key with an old key (or a key under one, e.g. trainer.resources_per_rank.num_gpus)
    replaced by its new one, warning once; other keys unchanged."""
    parts = key.split(".")
    old = ".".join(parts[:2])
    new = RENAMED_KEYS.get(old)
    if new is None:
        return key
    _warn(old, new, "override ")
    return ".".join([new, *parts[2:]])


def move_renamed_keys(data: dict, source: str = "") -> dict:
    """Raw config data with every old key of the `trainer` section moved to its new place, warning once for
    each; `source` (a file's name) is named in the warning. Changes `data` in place and returns it."""
    trainer = data.get("trainer")
    if not isinstance(trainer, dict):
        return data
    where = f"{source}: " if source else ""
    for old, new in RENAMED_KEYS.items():
        name = old.split(".", 1)[1]
        if name not in trainer:
            continue
        section, key = new.split(".")[1:]
        node = trainer.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"trainer.{section} must be a mapping, got {node!r}")
        if key in node:
            raise ConfigError(f"{where}{old} and {new} are both set; {old} is the old name of {new}: keep {new}")
        _warn(old, new, where)
        node[key] = trainer.pop(name)
    return data
