"""Checkpoint layout: <run_dir>/checkpoints/step_NNNNNN/ holds the trainer's sharded model and
optimizer (torch.distributed.checkpoint, under trainer/), the loop state (state.json: step, data
cursor, weights digest) and the config the run used (config.yaml)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

STATE_FILE = "state.json"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def write_state(path: Path, state: dict, cfg: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "config.yaml", "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
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


def read_checkpoint(path: Path) -> tuple[dict, dict]:
    """(loop state, config) of a checkpoint directory."""
    state = json.loads((path / STATE_FILE).read_text())
    with open(path / "config.yaml") as f:
        cfg = yaml.safe_load(f)
    return state, cfg
