"""The quality study's runs several at a time (`bench.quality_study --concurrent N`). The study's policies are small:
one run leaves most of a GPU idle, and its steps wait on the host. N runs then share the machine. Each run is
advanced by a child process of its own (`bench.quality_study --one-run`, the same pieces and checkpoints as a
sequential study). With RAY_ADDRESS unset or `local`, each child starts a Ray of its own on this machine, so
each run gets the resources its config asks for. With RAY_ADDRESS naming a cluster, the runs share that
cluster's resources: give each run its share with the setting's overrides
(`rollout.resources_per_worker.num_gpus=`, `trainer.placement.resources_per_rank.num_gpus=`).

Rule: a seed is warmed once. A run whose seed has no warmed policy yet starts only while no other run of that seed
runs. The first run of a seed warms it (quality_study.warm_start), and the others start from its checkpoint.
A run's output goes to <out>/<setting>/logs/<arm>-seed<k>.log. The study's own stderr says when each run starts
and ends, and every PROGRESS_S seconds each running run's steps and latest reward and max |Δ log-prob|.
"""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

PROGRESS_S = 30.0  # how often the running runs' step counts are reported
POLL_S = 1.0


@dataclass
class Child:
    arm: str
    seed: int
    proc: subprocess.Popen
    log: Path
    started: float

    @property
    def name(self) -> str:
        return f"{self.arm}-seed{self.seed}"


def next_startable(pending: list[tuple[str, int]], running: list[tuple[str, int]],
                   warmed: set[int]) -> tuple[str, int] | None:
    """The first pending (arm, seed) that may start now: its seed warmed already, or no run of its seed running
    (the run that starts then warms it)."""
    busy = {seed for _, seed in running}
    for arm, seed in pending:
        if seed in warmed or seed not in busy:
            return arm, seed
    return None


def warmed_seeds(root: Path, seeds, needs_warmup: bool) -> set[int]:
    """The seeds whose runs can start from a saved warm policy (every seed where the config warms nothing)."""
    if not needs_warmup:
        return set(seeds)
    return {s for s in seeds if (root / f"warm-seed{s}" / "config.json").is_file()}


def run_concurrently(runs: list[tuple[str, int]], concurrent: int, child_argv: Callable[[str, int, float | None], list[str]],
                     root: Path, needs_warmup: bool, steps: int, deadline: float | None,
                     steps_done: Callable[[Path], int], describe: Callable[[Path], str],
                     say: Callable[[str], None]) -> list[str]:
    """Advance `runs` (arm, seed), up to `concurrent` at once, each in a child process running child_argv(arm,
    seed, minutes left); none starts after `deadline` (time.monotonic()). describe(run_dir): what the progress
    lines say of a run after its step count. Returns the runs whose child failed (each named with its log); the
    others have run to `steps` or to the deadline."""
    pending, running, failed = list(runs), [], []
    seeds = {seed for _, seed in runs}
    (root / "logs").mkdir(parents=True, exist_ok=True)
    last_progress = time.monotonic()
    try:
        while pending or running:
            for child in [c for c in running if c.proc.poll() is not None]:
                running.remove(child)
                done = steps_done(root / child.name)
                took = time.monotonic() - child.started
                if child.proc.returncode != 0:
                    failed.append(f"{child.name} (exit {child.proc.returncode}; log {child.log})")
                    say(f"{child.name} failed after {took:.0f} s; the end of {child.log}:\n{_tail(child.log)}")
                else:
                    say(f"{child.name}: {done}/{steps} steps{describe(root / child.name)}, this piece {took:.0f} s")
            now = time.monotonic()
            while pending and len(running) < concurrent and (deadline is None or now < deadline):
                chosen = next_startable(pending, [(c.arm, c.seed) for c in running],
                                        warmed_seeds(root, seeds, needs_warmup))
                if chosen is None:
                    break
                pending.remove(chosen)
                arm, seed = chosen
                log = root / "logs" / f"{arm}-seed{seed}.log"
                minutes = None if deadline is None else (deadline - now) / 60
                with open(log, "a") as out:
                    proc = subprocess.Popen(child_argv(arm, seed, minutes), stdout=out, stderr=subprocess.STDOUT)
                running.append(Child(arm, seed, proc, log, now))
                say(f"{arm}-seed{seed}: started at step {steps_done(root / f'{arm}-seed{seed}')} of {steps} "
                    f"({len(running)} running, {len(pending)} waiting; log {log})")
            if not running and pending:  # past the deadline with nothing left running
                break
            if running and now - last_progress >= PROGRESS_S:
                last_progress = now
                say("steps so far: " + "; ".join(f"{c.name} {steps_done(root / c.name)}/{steps}{describe(root / c.name)}"
                                                 for c in running))
            time.sleep(POLL_S)
    finally:
        for child in running:  # interrupted: no run is left advancing behind the study's back
            child.proc.terminate()
        for child in running:
            child.proc.wait()
    return failed


def _tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return text[-chars:]

