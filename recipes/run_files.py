"""What a GRPO run writes in its directory besides metrics and checkpoints: the directory itself with the
run's config.yaml, and each step's rollouts."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from .checkpoint import CONFIG_FILE
from .config import RecipeConfig


def run_dir_of(cfg: RecipeConfig, ckpt: Path | None) -> Path:
    if cfg.run_dir:
        path = Path(cfg.run_dir).expanduser().resolve()
    elif ckpt is not None:
        path = ckpt.parent.parent  # continue in the run the checkpoint belongs to
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"{cfg.name}-{cfg.rollout.determinism}-{stamp}-{uuid.uuid4().hex[:6]}"
        path = Path(cfg.output_dir).expanduser().resolve() / name
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(cfg.to_yaml())
    return path


def save_rollouts(run_dir: Path, step: int, rollouts, rewards) -> None:
    """<run_dir>/rollouts/step_N.jsonl; JSON floats round-trip exactly, so files compare bitwise."""
    out = run_dir / "rollouts"
    out.mkdir(exist_ok=True)
    with open(out / f"step_{step:06d}.jsonl", "w") as f:
        for ro, r in zip(rollouts, rewards):
            line = {"prompt": ro.prompt_token_ids, "tokens": ro.token_ids, "logprobs": ro.logprobs,
                    "weight_versions": ro.weight_versions, "finish_reason": ro.finish_reason, "reward": r}
            if ro.routed_experts is not None:
                line["routed_experts"] = ro.routed_experts
            if hasattr(ro, "model_mask"):  # a multi-turn episode (recipes/episodes.py): which tokens the model's
                line.update(model_mask=ro.model_mask, turns=ro.turns, end=ro.end, episode=ro.episode,
                            segment=ro.segment)
            f.write(json.dumps(line) + "\n")
