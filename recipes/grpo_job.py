"""One GRPO job on an initialised Ray: its task and starting model, rollout pool and trainer ranks, then
its steps (rollouts, rewards, the update, the weight push, metrics and checkpoints), one record each."""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

import kernels as K
from rollout_service.service.client import DEFAULT_NAMESPACE
from rollout_service.service.pool import start_pool
from rollout_service.service.ray_cluster import with_tree_width
from rollout_service.weights import WeightMismatchError

from .batch import Sample, split_for_ranks
from .checkpoint import checkpoint_dir, find_checkpoint, read_state, write_state
from .config import CanonicalTreeConfig, RecipeConfig
from .episodes import EpisodeRollout, episode_metrics, episode_of, group_episodes
from .grpo_loss import group_advantages
from .memory_plan import MemoryPlan, measure_rank_gpu, plan_memory
from .metrics import MetricsLogger, StepProgress, step_metrics
from .models import initial_model, policy_config
from .placement import ranks_first_bundle, reserve_job_placement
from .prefix_cache_metrics import prefix_cache_metrics
from .rollout_queue import RolloutQueue
from .rollouts import (
    engine_options,
    engines_sleep,
    group_requests,
    prompt_indices,
    records_routing,
    rollouts_digest,
)
from .run_files import run_dir_of, save_rollouts
from .run_storage import check_shared_run_dir
from .step_push import landed, sync_weights, to_run_versions
from .task import build_task
from .trainer_group import TrainerGroup
from .warmup import answer_examples, supervised_warmup


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
    (recipes.placement.JobPlacement.workers)."""
    rollout_cfg = cfg.rollout
    return start_pool(model, num_workers=rollout_cfg.num_workers, name=pool_name, engine_kwargs=engine_options(cfg),
                      resources_per_worker=with_tree_width(rollout_cfg.resources_per_worker,
                                                           cfg.canonical.tree_segments),
                      namespace=namespace, colocate_with=shared, start_timeout_s=rollout_cfg.start_timeout_s)


def _score(task, rows: list[dict], prompts: list[list[int]], rollouts, n: int, scale: bool):
    """Rewards [P, n], one per episode, and the training samples, one per rollout, each with its episode's
    group-normalised advantage. A multi-turn episode is one rollout per segment (recipes/episodes.py): its
    segments share the episode's reward and advantage, and groups stay the n episodes of a prompt."""
    episode = episode_of(rollouts)
    first = {}  # episode -> its first rollout, which holds the episode's reward
    for e, ro in zip(episode, rollouts):
        first.setdefault(e, ro)
    rewards = torch.tensor([ro.reward if isinstance(ro, EpisodeRollout)  # a multi-turn episode's own
                            else task.reward(ro.token_ids, rows[e // n]["answer"]) for e, ro in first.items()])
    rewards = rewards.view(-1, n)
    adv = group_advantages(rewards, scale=scale).view(-1).tolist()
    samples = [Sample(list(prompts[i]), list(ro.token_ids), list(ro.logprobs), adv[episode[i]], ro.routed_experts,
                      None if ro.weight_versions is None else list(ro.weight_versions),
                      ro.model_mask if isinstance(ro, EpisodeRollout) else None)
               for i, ro in enumerate(rollouts)]
    return rewards, samples


def _group_sizes(rollouts, n: int) -> list[int]:
    """Each prompt group's number of rollouts (training samples), in order: n, or more where an episode is
    several segments."""
    sizes: dict[int, int] = {}
    for e in episode_of(rollouts):
        sizes[e // n] = sizes.get(e // n, 0) + 1
    return list(sizes.values())


def _rollout_rewards(rollouts, rewards: torch.Tensor) -> list[float]:
    """Each rollout's reward, its episode's (rewards [P, n], one per episode)."""
    flat = rewards.view(-1).tolist()
    return [flat[e] for e in episode_of(rollouts)]


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
    job has started, `gpus` names the GPUs Ray gave its workers and its ranks, and while its steps run
    `pool` (the RolloutClient) and `trainer` (the TrainerGroup) are its actors' handles (None after)."""

    def __init__(self, cfg: RecipeConfig, resume: str | Path | None = None, placement_group=None):
        self.step0, self.cursor, self.ckpt, self.state = 0, 0, None, {}
        self.placement_group = placement_group
        self.gpus: dict[str, list[str]] = {}
        self.pool = self.trainer = None
        if resume is not None:
            self.ckpt = find_checkpoint(resume)
            self.state = read_state(self.ckpt)
            self.step0, self.cursor = self.state["step"], self.state["cursor"]
        K.set_tree_segments(cfg.canonical.tree_segments or K.tree_segments())
        # null meant the process's width: the run records the one it ran with
        self.cfg = dataclasses.replace(cfg, canonical=CanonicalTreeConfig(tree_segments=K.tree_segments()))
        self.run_dir = run_dir_of(self.cfg, self.ckpt)

    def steps(self, progress: bool = True) -> Iterator[dict]:
        yield from _steps(self, progress)


def _steps(job: GRPOJob, progress: bool) -> Iterator[dict]:
    cfg, run_dir, ckpt, state, step0, cursor = job.cfg, job.run_dir, job.ckpt, job.state, job.step0, job.cursor
    rollout_cfg, trainer_cfg, loop_cfg = cfg.rollout, cfg.trainer, cfg.train
    run_name = f"{cfg.name}-{rollout_cfg.determinism}"
    t_start = time.perf_counter()
    task = build_task(cfg)
    # before anything long starts: the plan fits a rank's GPU (a run that cannot fit is refused even where its
    # GPUs cannot be placed yet), the groups are placed, and every rank's node shares the run directory
    memory_plan = check_memory_plan(job, task)
    placement = reserve_job_placement(cfg, job.placement_group)
    try:
        rank_options = _rank_options(cfg)
        check_shared_run_dir(run_dir, placement.ranks, placement.first_rank_bundle, trainer_cfg.num_ranks,
                             rank_options.placement.resources_per_rank.get("runtime_env"))
    except BaseException:
        placement.release()
        raise
    t_checked = time.perf_counter()
    model = starting_model(cfg, task, resumed=ckpt is not None)
    t_model = time.perf_counter()
    pad_id = task.tokenizer.pad_token_id if task.tokenizer.pad_token_id is not None else task.stop_token_ids[0]
    pool_name, namespace = rollout_cfg.pool_name or f"grpo-{uuid.uuid4().hex[:8]}", DEFAULT_NAMESPACE
    pool = trainer = logger = queue = None
    canonical, sleeps = cfg.numerics == "canonical", engines_sleep(cfg)
    try:
        pool = job.pool = _start_rollout_pool(cfg, model, pool_name, namespace, placement.workers)
        # MoE: rollouts record routing where the workers can, the trainer compares its own
        routed = records_routing(rollout_cfg, model, pool.capabilities())
        t_pool = time.perf_counter()
        trainer = job.trainer = TrainerGroup(rank_options, model, rollout_cfg.temperature, cfg.numerics,
                                             colocate_with=placement.ranks,
                                             first_bundle=placement.first_rank_bundle, memory_plan=memory_plan,
                                             lora=cfg.model.lora, seed=cfg.seed, run_dir=run_dir)
        pool_stats = pool.stats()  # the step's prefix-cache hits are counted from one snapshot to the next
        job.gpus = {"rollout": [g for w in pool_stats["workers"] for g in w["gpu_ids"]],
                    "trainer": trainer.gpu_ids}
        if canonical:
            K.check_canonical({"rollout workers": pool.info["canonical"], "trainer ranks": trainer.canonical})
        if ckpt is not None:
            trainer.load(str(ckpt / "trainer"))
        client = pool  # rollouts and weight pushes alike go through the pool's own handle
        keep = loop_cfg.async_steps + 1 if loop_cfg.async_steps else 0  # versions a step's rollouts can be of
        sync = sync_weights(trainer, pool, step0, keep)  # the pool starts from the trainer's
        if state.get("digest") not in (None, sync["digest"]):
            raise WeightMismatchError(f"checkpoint weights {sync['digest']} != recorded {state['digest']}")
        logger = MetricsLogger(run_dir, cfg, run_name)
        _say_ready(job, (t_start, t_checked, t_model, t_pool))

        def generate(step: int):
            first = cursor0 + (step - step0 - 1) * loop_cfg.prompts_per_step
            indices = prompt_indices(first, loop_cfg.prompts_per_step, len(task.dataset), cfg.seed)
            rows = [task.dataset[i] for i in indices]
            if task.environment is not None:  # multi-turn: each turn continues from its episode's exact ids
                prompts, episodes = group_episodes(task, rows, indices, step, rollout_cfg, cfg.seed, client.generate,
                                                   model.config.max_position_embeddings, adapter)
                return rows, prompts, episodes
            prompts, params = group_requests([r["prompt_ids"] for r in rows], indices, step, rollout_cfg, cfg.seed,
                                             task.stop_token_ids, routed, adapter)
            return rows, prompts, client.generate(prompts, params)

        adapter = None if cfg.model.lora is None else cfg.model.lora.name  # every request names the trained adapter
        cursor0 = cursor
        queue = RolloutQueue(generate, loop_cfg.steps, ahead=loop_cfg.async_steps)
        bar = StepProgress(loop_cfg.steps, initial=step0, desc=run_name, enabled=progress)
        for step in range(step0 + 1, loop_cfg.steps + 1):
            t_step = time.perf_counter()
            batch, waited = queue.get(step)
            rows, prompts, rollouts = batch.rows, batch.prompts, batch.rollouts
            to_run_versions(rollouts, sync["pool_version"], sync["version"])
            _check_rollouts(rollouts)
            rewards, samples = _score(task, rows, prompts, rollouts, rollout_cfg.n, trainer_cfg.loss.scale_advantages)
            plans, tokens = _rank_plans(samples, trainer_cfg, pad_id, _group_sizes(rollouts, rollout_cfg.n))
            trainer_version = sync["version"]
            stale = tuple(sorted({v for s in samples for v in s.weight_versions or ()} - {trainer_version}))
            t2 = time.perf_counter()
            if sleeps:  # the engines' memory goes to the trainer; the weight push wakes them
                client.sleep()
            t_slept = time.perf_counter() if sleeps else t2
            overlap = loop_cfg.async_steps > 0
            results = trainer.train_step(plans, tokens, stale, push_to=None if overlap else pool)
            t3 = time.perf_counter()
            sync = sync_weights(trainer, pool, step, keep, overlap=overlap)
            cursor += loop_cfg.prompts_per_step

            metrics = step_metrics(rollouts, rewards, results, sum(tokens),
                                   {"rollout": waited, "generate": batch.seconds, "train": t3 - t_slept,
                                    "sync": sync["seconds"], "sleep": t_slept - t2}, trainer_version)
            metrics.update(_push_metrics(sync, cursor, rollouts))
            metrics.update(episode_metrics(rollouts))
            pool_stats, stats_before = pool.stats(), pool_stats
            metrics.update(prefix_cache_metrics(stats_before, pool_stats))
            if loop_cfg.save_rollouts:
                save_rollouts(run_dir, step, rollouts, _rollout_rewards(rollouts, rewards))
            metrics["perf/checkpoint_s"] = _checkpoint(cfg, run_dir, trainer, step, cursor, sync["digest"])
            metrics["perf/step_s"] = time.perf_counter() - t_step
            logger.log(step, metrics)
            bar.step(step, metrics)
            yield {"step": step, **metrics}
        landed(trainer)  # the last push, when it was left sending
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
        job.pool = job.trainer = None
        placement.release()


def _rank_options(cfg: RecipeConfig):
    """The trainer section the ranks start with: each rank's actor options carry the run's tree width, and
    a GPU rank asks for its whole GPU unless resources_per_rank says otherwise (rank_bundles)."""
    trainer_cfg = cfg.trainer
    resources = dict(trainer_cfg.placement.resources_per_rank)
    if trainer_cfg.device == "cuda" and cfg.placement == "split":
        resources.setdefault("num_gpus", 1)
    return dataclasses.replace(trainer_cfg, placement=dataclasses.replace(
        trainer_cfg.placement, resources_per_rank=with_tree_width(resources, cfg.canonical.tree_segments)))


def _say_ready(job: GRPOJob, marks: tuple[float, float, float, float]) -> None:
    """Say the set-up's seconds by part. marks: when it started; when the task, the memory check, the placement
    and the run directory's check were done; when the starting model was built (and warmed up); when the
    rollout pool had started."""
    t_start, t_checked, t_model, t_pool = marks
    t_ready = time.perf_counter()
    _say(f"run directory {job.run_dir}; set up in {t_ready - t_start:.0f}s (task, memory check and placement "
         f"{t_checked - t_start:.0f}s, model {t_model - t_checked:.0f}s, rollout pool {t_pool - t_model:.0f}s, "
         f"trainer ranks {t_ready - t_pool:.0f}s)")
    if job.gpus["rollout"] or job.gpus["trainer"]:
        _say(f"GPUs (Ray's ids): rollout workers {job.gpus['rollout']}, trainer ranks {job.gpus['trainer']}")


def _check_rollouts(rollouts) -> None:
    failed = [ro for ro in rollouts if not ro.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} rollouts failed, e.g. {failed[0].finish_reason}: {failed[0].error}")


def _rank_plans(samples: list[Sample], trainer_cfg, pad_id: int, group_sizes: list[int] | None = None):
    """Each rank's mini- and micro-batches of the step's samples, and each mini-batch's tokens
    (recipes.batch.split_for_ranks, laid out as trainer.batching says); mini-batches of whole prompt groups
    (group_sizes: each group's samples)."""
    batching = trainer_cfg.batching
    return split_for_ranks(samples, trainer_cfg.num_ranks, batching.mini_batches, batching.micro_batch_size,
                           pad_id, batching.max_tokens_per_micro_batch, batching.packing, group_sizes)


def _push_metrics(sync: dict, cursor: int, rollouts) -> dict:
    """A step's record of its weight push (its phases, the weights' digest and version) and of its data."""
    metrics = {f"perf/sync_{phase}_s": s for phase, s in sync["phases"].items()}
    metrics.update({"data/cursor": cursor, "rollout/digest": rollouts_digest(rollouts),
                    "weights/digest": sync["digest"], "weights/version": sync["version"],
                    "weights/transport": sync["transport"], "weights/staged": sync["staged"]})
    return metrics


def _checkpoint(cfg: RecipeConfig, run_dir: Path, trainer, step: int, cursor: int, digest: str) -> float:
    """A checkpoint of `step` when train.save_every or train.save_final asks for one; its seconds."""
    loop_cfg, start = cfg.train, time.perf_counter()
    every = loop_cfg.save_every
    if (step == loop_cfg.steps and loop_cfg.save_final) or (every and step % every == 0):
        path = checkpoint_dir(run_dir, step)
        trainer.save(str(path / "trainer"))
        write_state(path, {"step": step, "cursor": cursor, "digest": digest}, cfg)
    return time.perf_counter() - start


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


def _say(msg: str) -> None:
    print(msg, flush=True)
