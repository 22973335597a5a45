"""The arms (overrides of one recipe config) and how a round runs them: each as a recipe run of its own,
or all side by side in this process taking steps in turns."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

from recipes.config import load_config
from recipes.metrics import read_metrics

# The stock arm pads its rows within the same token budget: transformers' padding-free path over SDPA builds a
# dense block-diagonal mask per packed row, which makes it the slower of its two paths where flash-attn's varlen
# kernels (its fast padding-free path) are not installed (bench/results/2026-12-02-h200-long-completions).
ARMS = {"canonical": [], "stock": ["numerics=stock", "rollout.determinism=off", "trainer.loss.old_logprobs=recompute",
                                   "trainer.batching.packing=false"],
        "async": ["train.async_steps=1"],
        "async-in-flight": ["train.async_steps=1", "trainer.weight_push.switch=switch-in-flight",
                            "trainer.weight_push.transport=object_store"]}
CPU_SMOKE = ["warmup.steps=10", "train.prompts_per_step=8", "metrics.wandb=false"]


def arm_overrides(arm: str, steps: int, extra: list[str]) -> list[str]:
    return [f"train.steps={steps}", "train.save_every=0", "train.save_final=false", "metrics.wandb=false",
            *ARMS[arm], *extra]


def run_arm(config: str, arm: str, steps: int, extra: list[str], run_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "recipes.grpo", "--config", config, "--no-progress", "--run-dir", str(run_dir),
           *arm_overrides(arm, steps, extra)]
    print(f"[bench] {arm}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return read_metrics(run_dir)


def half_shares(config: str, overrides: list[str]) -> list[str]:
    """Overrides that halve the workers' and ranks' CPU and GPU shares, so that two jobs fit where one
    did. Ray's shares place the actors; the CPU share also sets OMP_NUM_THREADS in them (Ray's
    default), which the ranks override with trainer.torch_threads."""
    cfg = load_config(config, overrides)
    out = []
    for key, options in (("rollout.resources_per_worker", cfg.rollout.resources_per_worker),
                         ("trainer.placement.resources_per_rank", cfg.trainer.placement.resources_per_rank)):
        for resource in ("num_cpus", "num_gpus"):
            if options.get(resource):
                out.append(f"{key}.{resource}={options[resource] / 2}")
    return out


def run_interleaved(config: str, arms: list[str], steps: int, extra: list[str], tmp: Path):
    """The arms' jobs side by side in this process (one Ray session), taking steps in turns: step k of
    each arm, in the given order at odd k and reversed at even k. Each job's step is timed by the
    recipe as in a run of its own; the other job is idle meanwhile (synchronous arms only). Returns
    each arm's step records, and the GPUs Ray gave its workers and ranks.

    Rule: both jobs take half of each bundle of one placement group, reserved as one job's would be:
    the arms' workers share their GPUs, as do their ranks, and a split job's worker is never on its
    rank's GPU (Ray packs two half shares onto one GPU when no bundle keeps them apart, which would
    make a split arm a colocated one whose weights go by CUDA IPC)."""
    from recipes.grpo import GRPOJob, reserve_placement
    from rollout_service.ray_placement import release
    from rollout_service.service.ray_cluster import init_ray
    started = init_ray()
    jobs, steppers, records = {}, {}, {arm: [] for arm in arms}
    group = None
    with contextlib.redirect_stdout(sys.stderr):  # the jobs' progress lines: stdout is the JSON's
        try:
            one_job = load_config(config, arm_overrides(arms[0], steps, extra))  # at one job's whole shares
            group = reserve_placement(one_job)
            for arm in arms:
                overrides = arm_overrides(arm, steps, extra)
                overrides += half_shares(config, overrides) + [f"run_dir={tmp / arm}"]
                print(f"[bench] {arm}, interleaved: {' '.join(overrides)}", flush=True)
                jobs[arm] = GRPOJob(load_config(config, overrides), placement_group=group)
                steppers[arm] = jobs[arm].steps(progress=False)
            for k in range(1, steps + 1):
                for arm in (arms if k % 2 else arms[::-1]):
                    records[arm].append(next(steppers[arm]))
                    print(f"[bench] {arm} step {k}: {records[arm][-1]['perf/step_s']:.3f}s", flush=True)
                if k == 1:
                    check_split_gpus(one_job.placement, {arm: job.gpus for arm, job in jobs.items()})
            for arm in arms:  # past the last step: the job lands its last push and tears down
                extra_step = next(steppers[arm], None)
                if extra_step is not None:
                    raise RuntimeError(f"{arm}: a step past train.steps={steps}: {extra_step['step']}")
        finally:
            for stepper in steppers.values():
                stepper.close()
            if group is not None and not started:
                release(group)
            if started:  # its workers' last log lines before the JSON, not into it
                import ray
                ray.shutdown()
    return records, {arm: job.gpus for arm, job in jobs.items()}


def check_split_gpus(placement: str, gpus: dict[str, dict[str, list[str]]]) -> None:
    """Refuses a split arm whose rollout workers and trainer ranks share a GPU (`gpus`: each arm's
    GRPOJob.gpus): its step would not be a split step."""
    if placement != "split":
        return
    for arm, where in gpus.items():
        both = sorted(set(where["rollout"]) & set(where["trainer"]))
        if both:
            raise RuntimeError(f"{arm}: split placement, but its rollout workers and trainer ranks share GPUs "
                               f"{both} (rollout {where['rollout']}, trainer {where['trainer']})")
