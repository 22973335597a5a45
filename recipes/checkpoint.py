"""Checkpoint layout: <run_dir>/checkpoints/step_NNNNNN/ holds the trainer's sharded model and
optimizer (torch.distributed.checkpoint, under trainer/), the loop state (state.json: step, data
cursor, weights digest) and the config the run used (config.yaml, read back by load_config)."""
from __future__ import annotations

import json
from pathlib import Path

from .config import RecipeConfig

STATE_FILE = "state.json"
CONFIG_FILE = "config.yaml"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def write_state(path: Path, state: dict, cfg: RecipeConfig) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(cfg.to_yaml())
    tmp = path / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path / STATE_FILE)  # written last: a checkpoint without it is incomplete


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the latest complete one of a run directory."""
    path = Path(path).expanduser().resolve()
    if (path / STATE_FILE).is_file():
        return path
    done = sorted(p for p in (path / "checkpoints").glob("step_*") if (p / STATE_FILE).is_file())
    if not done:
        raise FileNotFoundError(f"no complete checkpoint at {path}")
    return done[-1]


def read_state(path: Path) -> dict:
    """The loop state of a checkpoint directory (its config: load_config(path / CONFIG_FILE))."""
    return json.loads((path / STATE_FILE).read_text())
