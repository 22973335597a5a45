"""Recipe configuration: a YAML file over built-in defaults, then `key.sub=value` overrides."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

from kernels import TREE_WIDTHS
from rollout_service.params import DETERMINISM_MODES

DEFAULTS: dict = {
    "name": "grpo",
    "seed": 0,
    "output_dir": "~/zerokl-runs",  # absolute by default: `ray job submit` runs in a temporary copy
    "run_dir": None,  # default: <output_dir>/<name>-<time>
    "task": {"kind": "tiny"},
    # Row-parallel segment tree width (1, 2, 4 or 8: the largest TP degree that reproduces the trainer);
    # null = ZEROKL_TREE_SEGMENTS or 8. Given to every rollout worker and trainer rank.
    "canonical": {"tree_segments": None},
    "model": {"source": "tiny"},
    "warmup": {"steps": 0},
    "rollout": {
        "num_workers": 2,
        "pool_name": None,  # default: unique per run
        "engine": {},
        "resources_per_worker": {"num_cpus": 1},
        "determinism": "verified",
        "n": 8,  # samples per prompt (the GRPO group)
        "max_tokens": 16,
        "temperature": 1.0,
        "top_k": -1,
        "top_p": 1.0,
    },
    "trainer": {
        "num_ranks": 2,
        "device": "cpu",
        "resources_per_rank": {"num_cpus": 1},
        "torch_threads": 1,
        "lr": 1e-4,
        "betas": [0.9, 0.999],
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "clip_low": 0.2,
        "clip_high": 0.2,
        "mini_batches": 1,  # optimizer steps per rollout batch
        "micro_batch_size": 0,  # sequences per forward on a rank; 0 = all at once
        "old_logprobs": "rollout",  # or "recompute" (the trainer's own, before the update)
        "scale_advantages": True,  # divide by the group's std (GRPO); False = mean-centred only
    },
    "train": {
        "steps": 10,
        "prompts_per_step": 8,
        "save_every": 0,  # checkpoint every N steps (0 = only at the end)
        "save_rollouts": False,
    },
    "metrics": {"wandb": True, "wandb_project": "zerokl", "wandb_mode": None},
}


# YAML 1.1 (PyYAML) reads "1e-6" as a string; numbers in scientific notation are meant as floats.
_SCIENTIFIC = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def coerce_numbers(node):
    if isinstance(node, dict):
        return {k: coerce_numbers(v) for k, v in node.items()}
    if isinstance(node, list):
        return [coerce_numbers(v) for v in node]
    if isinstance(node, str) and _SCIENTIFIC.match(node.strip()):
        return float(node)
    return node


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_override(cfg: dict, item: str) -> None:
    """`a.b.c=value`, value parsed as YAML (numbers, booleans, lists, null)."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is not key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    node = cfg
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = coerce_numbers(yaml.safe_load(raw)) if raw != "" else ""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> dict:
    cfg = copy.deepcopy(DEFAULTS)
    if path is not None:
        with open(path) as f:
            cfg = deep_merge(cfg, coerce_numbers(yaml.safe_load(f) or {}))
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def validate(cfg: dict) -> None:
    r, t, tr = cfg["rollout"], cfg["trainer"], cfg["train"]
    if r["determinism"] is False:  # YAML 1.1 reads a bare `off` as false
        r["determinism"] = "off"
    if r["determinism"] not in DETERMINISM_MODES:
        raise ValueError(f"rollout.determinism must be verified, invariant or off, got {r['determinism']!r}")
    if r["n"] < 2:
        raise ValueError("rollout.n must be >= 2: group-normalised advantages need several samples per prompt")
    if t["old_logprobs"] not in ("rollout", "recompute"):
        raise ValueError(f"trainer.old_logprobs must be rollout or recompute, got {t['old_logprobs']!r}")
    width = cfg["canonical"]["tree_segments"]
    if width is not None and (width not in TREE_WIDTHS or isinstance(width, bool)):
        raise ValueError(f"canonical.tree_segments must be one of {TREE_WIDTHS} or null, got {width!r}")
    if t["num_ranks"] < 1 or t["mini_batches"] < 1:
        raise ValueError("trainer.num_ranks and trainer.mini_batches must be >= 1")
    if tr["prompts_per_step"] % t["mini_batches"]:
        raise ValueError("train.prompts_per_step must be divisible by trainer.mini_batches")
