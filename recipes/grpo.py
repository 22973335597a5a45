"""GRPO with deterministic rollouts and FSDP2 training; logs rollout-vs-train KL every step.

    ray job submit --working-dir . -- python -m recipes.grpo --config recipes/configs/tiny.yaml
    python -m recipes.grpo --config recipes/configs/tiny.yaml --determinism off   # the baseline
    python -m recipes.grpo --resume RUN_OR_CHECKPOINT_DIR [key.sub=value ...]

On a cluster of several nodes the same command runs under `ray job submit --address http://HEAD:8265
--working-dir . -- ...`; the config places the workers and ranks (recipes/placement.py) and output_dir must
be a directory every node shares (the job checks it before it starts: recipes/run_storage.py).

Each step: prompts from the task's dataset -> n seeded rollouts per prompt through RolloutClient ->
rewards -> group-normalised advantages -> clipped policy-gradient update on the FSDP2 trainer ranks ->
the new weights pushed to the rollout pool, digests checked. With train.async_steps = k the rollouts
of the next k steps are generated while the trainer steps (RolloutQueue); each token carries the
weight version it was sampled with, the loss divides by the rollout's own log-probs (the behaviour
policy's, exactly), and the rollout/train agreement is measured against that version's weights.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path

from rollout_service.params import DETERMINISM_MODES
from rollout_service.service.ray_cluster import init_ray, original_error

from .checkpoint import CONFIG_FILE, find_checkpoint
from .config import ConfigError, RecipeConfig, load_config
from .grpo_job import GRPOJob, run, starting_model
from .memory_plan import TrainerOutOfMemory
from .metrics import step_split
from .placement import placement_bundles, reserve_placement
from .rank_loss import TrainerRankLost

# the recipe's API, besides its command line
__all__ = ["GRPOJob", "build_config", "main", "placement_bundles", "reserve_placement", "run", "starting_model"]

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"


def resumed_checkpoint(resume: str) -> Path:
    """--resume's checkpoint; a path without one is a ConfigError, refused before any Ray actor starts."""
    try:
        return find_checkpoint(resume)
    except FileNotFoundError as e:
        raise ConfigError(f"--resume {resume}: {e}") from None


def build_config(args) -> RecipeConfig:
    """Config from --config (or, when resuming without one, the checkpoint's), then the overrides."""
    path = args.config or DEFAULT_CONFIG
    if args.resume is not None:
        checkpoint = resumed_checkpoint(args.resume)
        path = args.config or checkpoint / CONFIG_FILE
    cfg = load_config(path, args.overrides)
    if args.determinism is not None:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, determinism=args.determinism))
    if args.run_dir is not None:
        cfg = dataclasses.replace(cfg, run_dir=args.run_dir)
    return cfg


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m recipes.grpo", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG.name}, the tiny CPU run)")
    ap.add_argument("--determinism", choices=DETERMINISM_MODES, default=None,
                    help="rollout mode; 'off' = fast path only, the baseline whose KL is not zero")
    ap.add_argument("--resume", default=None, help="a run directory (its latest checkpoint) or a checkpoint")
    ap.add_argument("--run-dir", default=None, help="where metrics and checkpoints go")
    ap.add_argument("--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else local)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = build_config(args)
        init_ray(args.ray_address)
        result = run(cfg, resume=args.resume, progress=not args.no_progress)
    except Exception as e:
        error = original_error(e)  # a trainer rank's own error out of Ray's wrapper
        if not isinstance(error, (ConfigError, TrainerOutOfMemory, TrainerRankLost)):
            raise
        # Rule: a run its config (or its memory plan, a ConfigError) refuses, whose step ran out of memory, or
        # that lost a trainer rank, ends with the message, its numbers and the knobs (--resume), not a
        # traceback; status 2 for a refusal
        print(f"{ap.prog}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2 if isinstance(error, ConfigError) else 1) from None
    last = result["records"][-1] if result["records"] else {}
    if last:
        print(f"final step {last['step']}: reward {last['reward/mean']:.3f}, "
              f"rollout_train/kl {last['rollout_train/kl']}, "
              f"max |Δ logprob| {last['rollout_train/max_abs_logprob_diff']}"
              + (f", routing agreement {last['rollout_train/routing_agreement']}"
                 if "rollout_train/routing_agreement" in last else ""))
        print(step_split(result["records"]))
    run_dir = result["run_dir"]
    print(f"run directory: {run_dir}")
    plot = f"python -m recipes.plot {shlex.quote(run_dir)} --out {shlex.quote(os.path.join(run_dir, 'curves.png'))}"
    print(f"plot its curves with\n  {plot}", flush=True)
    return result


if __name__ == "__main__":
    main()
