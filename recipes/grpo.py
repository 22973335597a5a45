"""GRPO with deterministic rollouts and FSDP2 training; logs rollout-vs-train KL every step.

    ray job submit --working-dir . -- python -m recipes.grpo --config recipes/configs/tiny.yaml
    python -m recipes.grpo --config recipes/configs/tiny.yaml --determinism off   # the baseline
    python -m recipes.grpo --resume RUN_OR_CHECKPOINT_DIR [key.sub=value ...]

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
import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import ray
import torch

import kernels as K

from rollout_service.service.client import DEFAULT_NAMESPACE, RolloutClient
from rollout_service.params import DETERMINISM_MODES
from rollout_service.service.pool import start_pool
from rollout_service.service.ray_cluster import init_ray, original_error, release, reserve, with_tree_width
from rollout_service.weights import WeightMismatchError

from .batch import Sample, split_for_ranks
from .checkpoint import CONFIG_FILE, checkpoint_dir, find_checkpoint, read_state, write_state
from .config import CanonicalTreeConfig, ConfigError, RecipeConfig, load_config
from .grpo_loss import group_advantages
from .memory_plan import MemoryPlan, TrainerOutOfMemory, measure_rank_gpu, plan_memory
from .metrics import MetricsLogger, StepProgress, step_metrics, step_split
from .models import initial_model, policy_config
from .rollout_queue import RolloutQueue
from .rollouts import engine_options, engines_sleep, group_requests, prompt_indices, records_routing, rollouts_digest
from .task import build_task
from .trainer_group import TrainerGroup
from .warmup import answer_examples, supervised_warmup

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"


def _run_dir(cfg: RecipeConfig, ckpt: Path | None) -> Path:
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


def starting_model(cfg: RecipeConfig, task, resumed: bool) -> torch.nn.Module:
    """The initial policy; a resumed run loads its checkpoint over it, so no warm-up then."""
    warm = cfg.warmup
    # built where the warm-up runs: a 1.5B model initialises in a second on a GPU, a minute on a CPU
    with torch.device(warm.device if not resumed and warm.steps > 0 else "cpu"):
        model = initial_model(cfg, task.tokenizer)
    if not resumed and warm.steps > 0:
        model = supervised_warmup(model, answer_examples(task), warm.steps, lr=warm.lr,
                                  batch_size=warm.batch_size, seed=cfg.seed, device=warm.device)
    return model.cpu()


def _start_rollout_pool(cfg: RecipeConfig, model, pool_name: str, namespace: str, shared):
    """The rollout workers, each told the run's tree width; worker i on bundle i of `shared`, if given
    (placement_bundles)."""
    rollout_cfg = cfg.rollout
    return start_pool(model, num_workers=rollout_cfg.num_workers, name=pool_name, engine_kwargs=engine_options(cfg),
                      resources_per_worker=with_tree_width(rollout_cfg.resources_per_worker,
                                                           cfg.canonical.tree_segments),
                      namespace=namespace, colocate_with=shared, start_timeout_s=rollout_cfg.start_timeout_s)


def _sync(trainer, pool: RolloutClient, step: int, keep_versions: int, overlap: bool = False) -> dict:
    """Push the trainer's weights after `step` (0: the starting weights); the result carries the pool's
    weight version that now holds them and the run's version of those weights, `step`: a pool counts
    its own pushes, a run (resumed or not) counts steps. The trainer ranks keep the newest versions
    when asynchronous steps will score rollouts of older ones.

    overlap (asynchronous steps): a staged push returns once its checks have passed and the pool has
    drained, and sends behind the next train step; the next call (or _landed at the end) first waits for
    it to land. Its seconds ("seconds") are what the caller waited for: that wait,
    then this push up to its send; "behind_send" / "behind_finish" in phases ran behind the last step.
    Otherwise a push queued behind the train step (TrainerGroup.train_step's push_to) may have started
    before this call: "seconds" is this call's wait, phases["push"] the push's own time on rank 0."""
    start = time.perf_counter()
    last = _landed(trainer)
    result = trainer.push_weights(pool, overlap)
    result["phases"]["push"] = result["seconds"]
    if result["pool_version"] is None:
        result["pool_version"] = pool.stats()["weight_version"]
    result["version"] = step
    if keep_versions:
        trainer.keep_version(step, keep_versions)
    if last is not None:
        result["phases"].update({"wait": last["wait"], **{f"behind_{k}": v for k, v in last["behind"].items()}})
    result["seconds"] = time.perf_counter() - start
    return result


def _landed(trainer) -> dict | None:
    """Wait for a push still sending (see _sync) to land (its verdict is the pool's, which adopts only the
    digest the push checked)."""
    return trainer.finish_push()


def _to_run_versions(rollouts, pool_version: int, run_version: int) -> None:
    """Rollouts' weight versions from the pool's count of pushes to the run's (the step of the weights)."""
    shift = run_version - pool_version
    for ro in rollouts:
        if ro.weight_versions is not None:
            ro.weight_versions = [v + shift for v in ro.weight_versions]


def _score(task, rows: list[dict], prompts: list[list[int]], rollouts, n: int, scale: bool):
    """Rewards [P, n] and the training samples with group-normalised advantages."""
    rewards = torch.tensor([task.reward(ro.token_ids, rows[i // n]["answer"]) for i, ro in enumerate(rollouts)])
    rewards = rewards.view(-1, n)
    adv = group_advantages(rewards, scale=scale).view(-1).tolist()
    samples = [Sample(list(prompts[i]), list(ro.token_ids), list(ro.logprobs), adv[i], ro.routed_experts,
                      None if ro.weight_versions is None else list(ro.weight_versions))
               for i, ro in enumerate(rollouts)]
    return rewards, samples


def run(cfg: RecipeConfig, resume: str | Path | None = None, progress: bool = True) -> dict:
    """Run (or continue) a GRPO job on an initialised Ray; returns {"run_dir", "records"}."""
    job = GRPOJob(cfg, resume)
    return {"run_dir": str(job.run_dir), "records": list(job.steps(progress))}


class GRPOJob:
    """One GRPO job (new, or continued from `resume`) on an initialised Ray. steps() starts it and
    yields each step's record as the step ends, so that a caller can take the steps of two jobs in
    turns on the same GPUs (bench.grpo_step --interleave); its workers and ranks are torn down when the
    generator ends or is closed.

    placement_group: one the caller reserved with placement_bundles(cfg)'s bundles, whose shares the
    job's actors take instead of reserving their own, e.g. two jobs sharing each bundle. Once the
    job has started, `gpus` names the GPUs Ray gave its workers and its ranks."""

    def __init__(self, cfg: RecipeConfig, resume: str | Path | None = None, placement_group=None):
        self.step0, self.cursor, self.ckpt, self.state = 0, 0, None, {}
        self.placement_group = placement_group
        self.gpus: dict[str, list[str]] = {}
        if resume is not None:
            self.ckpt = find_checkpoint(resume)
            self.state = read_state(self.ckpt)
            self.step0, self.cursor = self.state["step"], self.state["cursor"]
        K.set_tree_segments(cfg.canonical.tree_segments or K.tree_segments())
        # null meant the process's width: the run records the one it ran with
        self.cfg = dataclasses.replace(cfg, canonical=CanonicalTreeConfig(tree_segments=K.tree_segments()))
        self.run_dir = _run_dir(self.cfg, self.ckpt)

    def steps(self, progress: bool = True) -> Iterator[dict]:
        yield from _steps(self, progress)


def _steps(job: GRPOJob, progress: bool) -> Iterator[dict]:
    cfg, run_dir, ckpt, state, step0, cursor = job.cfg, job.run_dir, job.ckpt, job.state, job.step0, job.cursor
    rollout_cfg, trainer_cfg, loop_cfg = cfg.rollout, cfg.trainer, cfg.train
    run_name = f"{cfg.name}-{rollout_cfg.determinism}"
    t_start = time.perf_counter()
    task = build_task(cfg)
    memory_plan = check_memory_plan(job, task)
    model = starting_model(cfg, task, resumed=ckpt is not None)
    routed = records_routing(rollout_cfg, model)  # MoE: rollouts record routing, the trainer compares its own
    t_model = time.perf_counter()
    pad_id = task.tokenizer.pad_token_id if task.tokenizer.pad_token_id is not None else task.stop_token_ids[0]
    pool_name, namespace = rollout_cfg.pool_name or f"grpo-{uuid.uuid4().hex[:8]}", DEFAULT_NAMESPACE
    pool = trainer = logger = owned = queue = None
    colocated, canonical, sleeps = cfg.placement == "colocated", cfg.numerics == "canonical", engines_sleep(cfg)
    try:
        width = cfg.canonical.tree_segments
        shared = job.placement_group
        if shared is None and colocated:
            shared = owned = reserve_placement(cfg)
        pool = _start_rollout_pool(cfg, model, pool_name, namespace, shared)
        t_pool = time.perf_counter()
        rank_placement = trainer_cfg.placement
        ranks = dataclasses.replace(trainer_cfg, placement=dataclasses.replace(
            rank_placement, resources_per_rank=with_tree_width(rank_placement.resources_per_rank, width)))
        trainer = TrainerGroup(ranks, model, rollout_cfg.temperature, cfg.numerics, colocate_with=shared,
                               first_bundle=ranks_first_bundle(cfg), memory_plan=memory_plan)
        job.gpus = {"rollout": [g for w in pool.stats()["workers"] for g in w["gpu_ids"]],
                    "trainer": trainer.gpu_ids}
        if canonical:
            K.check_canonical({"rollout workers": pool.info["canonical"], "trainer ranks": trainer.canonical})
        if ckpt is not None:
            trainer.load(str(ckpt / "trainer"))
        client = pool  # rollouts and weight pushes alike go through the pool's own handle
        keep = loop_cfg.async_steps + 1 if loop_cfg.async_steps else 0  # versions a step's rollouts can be of
        sync = _sync(trainer, pool, step0, keep)  # the pool starts from the trainer's
        if state.get("digest") not in (None, sync["digest"]):
            raise WeightMismatchError(f"checkpoint weights {sync['digest']} != recorded {state['digest']}")
        logger = MetricsLogger(run_dir, cfg, run_name)
        t_ready = time.perf_counter()
        _say(f"run directory {run_dir}; set up in {t_ready - t_start:.0f}s (task and model {t_model - t_start:.0f}s, "
             f"rollout pool {t_pool - t_model:.0f}s, trainer ranks {t_ready - t_pool:.0f}s)")
        if job.gpus["rollout"] or job.gpus["trainer"]:
            _say(f"GPUs (Ray's ids): rollout workers {job.gpus['rollout']}, trainer ranks {job.gpus['trainer']}")

        def generate(step: int):
            first = cursor0 + (step - step0 - 1) * loop_cfg.prompts_per_step
            indices = prompt_indices(first, loop_cfg.prompts_per_step, len(task.dataset), cfg.seed)
            rows = [task.dataset[i] for i in indices]
            prompts, params = group_requests([r["prompt_ids"] for r in rows], indices, step, rollout_cfg, cfg.seed,
                                             task.stop_token_ids, routed)
            return rows, prompts, client.generate(prompts, params)

        cursor0 = cursor
        queue = RolloutQueue(generate, loop_cfg.steps, ahead=loop_cfg.async_steps)
        bar = StepProgress(loop_cfg.steps, initial=step0, desc=run_name, enabled=progress)
        for step in range(step0 + 1, loop_cfg.steps + 1):
            t_step = time.perf_counter()
            batch, waited = queue.get(step)
            rows, prompts, rollouts = batch.rows, batch.prompts, batch.rollouts
            _to_run_versions(rollouts, sync["pool_version"], sync["version"])
            failed = [ro for ro in rollouts if not ro.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} rollouts failed, e.g. {failed[0].finish_reason}: {failed[0].error}")
            rewards, samples = _score(task, rows, prompts, rollouts, rollout_cfg.n, trainer_cfg.loss.scale_advantages)
            batching = trainer_cfg.batching
            plans, tokens = split_for_ranks(samples, trainer_cfg.num_ranks, batching.mini_batches,
                                            batching.micro_batch_size, pad_id,
                                            batching.max_tokens_per_micro_batch, batching.packing)
            trainer_version = sync["version"]
            stale = tuple(sorted({v for s in samples for v in s.weight_versions or ()} - {trainer_version}))
            t2 = time.perf_counter()
            if sleeps:  # the engines' memory goes to the trainer; the weight push wakes them
                client.sleep()
            t_slept = time.perf_counter() if sleeps else t2
            overlap = loop_cfg.async_steps > 0
            results = trainer.train_step(plans, tokens, stale, push_to=None if overlap else pool)
            t3 = time.perf_counter()
            sync = _sync(trainer, pool, step, keep, overlap=overlap)
            cursor += loop_cfg.prompts_per_step

            metrics = step_metrics(rollouts, rewards, results, sum(tokens),
                                   {"rollout": waited, "generate": batch.seconds, "train": t3 - t_slept,
                                    "sync": sync["seconds"], "sleep": t_slept - t2}, trainer_version)
            metrics.update({f"perf/sync_{phase}_s": s for phase, s in sync["phases"].items()})
            metrics.update({"data/cursor": cursor, "rollout/digest": rollouts_digest(rollouts),
                            "weights/digest": sync["digest"], "weights/version": sync["version"],
                            "weights/transport": sync["transport"], "weights/staged": sync["staged"]})
            if loop_cfg.save_rollouts:
                _save_rollouts(run_dir, step, rollouts, rewards.view(-1).tolist())
            every = loop_cfg.save_every
            t_save = time.perf_counter()
            if (step == loop_cfg.steps and loop_cfg.save_final) or (every and step % every == 0):
                path = checkpoint_dir(run_dir, step)
                trainer.save(str(path / "trainer"))
                write_state(path, {"step": step, "cursor": cursor, "digest": sync["digest"]}, cfg)
            metrics["perf/checkpoint_s"] = time.perf_counter() - t_save
            metrics["perf/step_s"] = time.perf_counter() - t_step
            logger.log(step, metrics)
            bar.step(step, metrics)
            yield {"step": step, **metrics}
        _landed(trainer)  # the last push, when it was left sending
        bar.close()
    finally:
        if queue is not None:
            queue.close()
        if logger is not None:
            logger.close()
        if trainer is not None:
            trainer.close()
        if pool is not None:
            pool.shutdown()
        if owned is not None:
            release(owned)


def ranks_first_bundle(cfg: RecipeConfig) -> int:
    """The trainer ranks' first bundle of a job's placement group: colocated, worker i's (bundle i); split,
    the one after the workers' (placement_bundles)."""
    return 0 if cfg.placement == "colocated" else cfg.rollout.num_workers


def check_memory_plan(job: GRPOJob, task) -> MemoryPlan | None:
    """GPU ranks: the run's memory plan (recipes.memory_plan), checked against a GPU like a rank's before
    anything long starts (the model, its warm-up, the rollout pool); a plan that cannot fit raises
    MemoryPlanRefused. The ranks check it again against their own GPUs (TrainerRank.setup)."""
    cfg = job.cfg
    if cfg.trainer.device != "cuda":
        return None
    longest_prompt = max(len(ids) for ids in task.dataset["prompt_ids"])
    plan = plan_memory(cfg, policy_config(cfg, task.tokenizer), longest_prompt)
    gpu = measure_rank_gpu(cfg.trainer, job.placement_group, ranks_first_bundle(cfg))
    if gpu is None:
        _say("memory plan: no GPU answered in time; each trainer rank checks it against its own")
        return plan
    plan = plan.on_gpu(gpu)
    plan.check()
    _say(f"memory plan: about {plan.total / 2 ** 30:.1f} GiB of a trainer rank's GPU ({gpu.name}, "
         f"{gpu.total_bytes / 2 ** 30:.1f} GiB)")
    return plan


def placement_bundles(cfg: RecipeConfig) -> list[dict]:
    """The bundles of a job's placement group, in order. Colocated: one per trainer rank, holding rollout
    worker i and rank i: both actors' CPUs and the GPU (on GPU runs) that they share. Split: one per
    rollout worker, then one per rank, each holding its actor's resources, so that a worker's GPU is
    never a rank's (Ray packs fractional GPU shares onto one GPU when no bundle keeps them apart)."""
    w, t = cfg.rollout.resources_per_worker, cfg.trainer.placement.resources_per_rank

    def bundle(cpus: float, gpus: float) -> dict:
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    if cfg.placement == "split":
        rank_gpus = t.get("num_gpus", 1 if cfg.trainer.device == "cuda" else 0)
        return ([bundle(w.get("num_cpus", 1), w.get("num_gpus", 0))] * cfg.rollout.num_workers
                + [bundle(t.get("num_cpus", 1), rank_gpus)] * cfg.trainer.num_ranks)
    gpus = w.get("num_gpus", 0) + t.get("num_gpus", 0)
    if cfg.trainer.device == "cuda" and not 0 < t.get("num_gpus", 0) < 1:
        raise ValueError("placement: colocated on GPUs needs trainer.placement.resources_per_rank.num_gpus, a share "
                         "below 1 (the rollout worker takes the rest)")
    if gpus > 1:
        raise ValueError(f"placement: colocated shares one GPU per bundle: the worker's and the rank's num_gpus "
                         f"add up to {gpus} > 1")
    return [bundle(w.get("num_cpus", 1) + t.get("num_cpus", 1), gpus)] * cfg.trainer.num_ranks


def reserve_placement(cfg: RecipeConfig):
    """A placement group of placement_bundles(cfg) (cfg.trainer.placement.strategy), once it is ready."""
    group = reserve(placement_bundles(cfg), cfg.trainer.placement.strategy)
    ray.get(group.ready())
    return group


def _say(msg: str) -> None:
    print(msg, flush=True)


def _save_rollouts(run_dir: Path, step: int, rollouts, rewards) -> None:
    """<run_dir>/rollouts/step_N.jsonl; JSON floats round-trip exactly, so files compare bitwise."""
    out = run_dir / "rollouts"
    out.mkdir(exist_ok=True)
    with open(out / f"step_{step:06d}.jsonl", "w") as f:
        for ro, r in zip(rollouts, rewards):
            line = {"prompt": ro.prompt_token_ids, "tokens": ro.token_ids, "logprobs": ro.logprobs,
                    "weight_versions": ro.weight_versions, "finish_reason": ro.finish_reason, "reward": r}
            if ro.routed_experts is not None:
                line["routed_experts"] = ro.routed_experts
            f.write(json.dumps(line) + "\n")


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
        if not isinstance(error, (ConfigError, TrainerOutOfMemory)):
            raise
        # Rule: a run its config (or its memory plan, a ConfigError) refuses, or whose step ran out of
        # memory, ends with the message, its numbers and the knobs, not a traceback; status 2 for a refusal
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
