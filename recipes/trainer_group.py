"""The driver's handle on the FSDP2 trainer ranks (recipes.trainer.TrainerRank, one Ray actor each): starts
them, forms their process group, fans every call out to all of them."""
from __future__ import annotations

import torch

import kernels as K

from .config import TrainerConfig
from .memory_plan import MemoryPlan
from .rank_loss import gather_ranks
from .trainer import TrainerRank


class TrainerGroup:
    """Driver-side handle: starts the ranks, forms the process group, fans calls out to all ranks. A rank
    lost on any call (its actor died) raises recipes.rank_loss.TrainerRankLost, every rank killed."""

    def __init__(self, cfg: TrainerConfig, model: torch.nn.Module, temperature: float, numerics: str = "canonical",
                 colocate_with=None, first_bundle: int = 0, memory_plan: MemoryPlan | None = None, lora=None,
                 seed: int = 0, run_dir: str | None = None):
        """colocate_with: a placement group of the caller's whose bundles other actors share: rank r takes
        a share of bundle first_bundle + r. The colocated placement shares bundle r with rollout worker
        r; two jobs taking steps in turns on the same GPUs share each bundle (bench.grpo_step
        --interleave; a split job's ranks come after its workers' bundles). Without it, GPU ranks
        reserve a group of their own. `gpu_ids`: the GPUs Ray gave each rank, in rank order.
        memory_plan: the run's (recipes.memory_plan), given to every rank (TrainerRank). lora: the run's
        model.lora section (recipes.config.model.LoraSection), or None: the ranks train the whole model;
        seed: the run's (where the adapter starts). run_dir: the run's directory, which a lost rank's error
        names for --resume."""
        import ray

        self.world = cfg.num_ranks
        self.run_dir = None if run_dir is None else str(run_dir)
        self.nodes: list[dict | None] = [None] * self.world  # each rank's Ray node, as its setup reported it
        self._killed = False  # by _gather (a rank lost, or ranks stuck): nothing more is asked of them
        self._left_sending = False  # the last push returned while rank 0 sends it (push_weights overlap)
        self._queued_push = None  # (the pool, every rank's push call) queued by train_step
        opts = {"num_cpus": 1, **cfg.placement.resources_per_rank}
        self.placement = None
        per_rank = [dict(opts) for _ in range(self.world)]
        from rollout_service.ray_placement import on_bundle, reserve
        if colocate_with is not None:
            per_rank = [dict(opts, scheduling_strategy=on_bundle(colocate_with, first_bundle + r))
                        for r in range(self.world)]
        elif cfg.device == "cuda":
            opts.setdefault("num_gpus", 1)
            # One node where possible: NCCL stays intra-node and checkpoints land on one disk.
            bundle = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"]}
            self.placement = reserve([bundle] * self.world, cfg.placement.strategy)
            ray.get(self.placement.ready())
            per_rank = [dict(opts, scheduling_strategy=on_bundle(self.placement, r)) for r in range(self.world)]
        actor = ray.remote(TrainerRank)
        self.ranks = [actor.options(**per_rank[r]).remote(r, self.world, cfg, temperature, numerics, memory_plan,
                                                             lora, seed)
                      for r in range(self.world)]
        try:
            addr, port = self._gather([self.ranks[0].address.remote()])[0]
            model_ref = ray.put(model)
            infos = self._gather([a.setup.remote(addr, port, model_ref) for a in self.ranks])
            self.nodes = [info["node"] for info in infos]
            self.num_params = infos[0]["num_params"]
            self.gpu_ids = [g for info in infos for g in info["gpu_ids"]]
            self.canonical = None if numerics == "stock" else K.check_canonical(
                {f"trainer rank {r}": info["canonical"] for r, info in enumerate(infos)})
        except BaseException:
            self.kill()
            raise

    def _gather(self, refs: list) -> list:
        """The results of one call per rank (refs[r] is rank r's, a prefix of the ranks at start); a lost
        rank raises TrainerRankLost with every rank killed (recipes.rank_loss.gather_ranks)."""
        def kill():
            self._killed = True
            self.kill()
        return gather_ranks(refs, self.nodes, self.run_dir, kill)

    def _all(self, method: str, *args) -> list:
        return self._gather([getattr(a, method).remote(*args) for a in self.ranks])

    def train_step(self, plans: list[list[list[dict]]], tokens_per_mini: list[int],
                   stale_versions: tuple[int, ...] = (), push_to=None) -> list[dict]:
        """Every rank's train step. push_to: the pool (its RolloutClient) of the push that follows (a push not
        left sending): each rank's push call is queued behind its step now, so it starts as the step
        ends, and rank 0 arms it as the step starts (TrainerRank.train_step); push_weights with the same
        pool collects it."""
        import ray
        arm = [push_to] + [None] * (self.world - 1) if push_to is not None else [None] * self.world
        refs = [a.train_step.remote(plan, tokens_per_mini, stale_versions, armed)
                for a, plan, armed in zip(self.ranks, plans, arm)]
        if push_to is not None:
            self._queued_push = (push_to, [a.push_weights.remote(push_to, False, True) for a in self.ranks])
        try:
            return self._gather(refs)
        except BaseException:
            queued, self._queued_push = self._queued_push, None
            if queued is not None:  # its calls refuse to push after a failed step; their refusals are read
                # here, so that Ray does not report them as unhandled errors
                for ref in queued[1]:
                    try:
                        ray.get(ref, timeout=60)
                    except Exception:
                        pass
            raise

    def keep_version(self, version: int, keep: int) -> None:
        self._all("keep_version", version, keep)

    def full_state_dict(self) -> dict:
        return self._all("full_state_dict")[0]

    def push_weights(self, pool, overlap: bool = False) -> dict:
        queued, self._queued_push = self._queued_push, None
        if queued is not None and queued[0] == pool and not overlap:
            result = self._gather(queued[1])[0]
        else:
            if queued is not None:  # a push to another pool, or left sending: the queued one lands first
                self._gather(queued[1])
            result = self._all("push_weights", pool, overlap)[0]
        self._left_sending = result["sending"]
        return result

    def finish_push(self) -> dict | None:
        """TrainerRank.finish_push on rank 0 (it alone sends); no call when no push was left sending."""
        if not self._left_sending:
            return None
        self._left_sending = False
        return self._gather([self.ranks[0].finish_push.remote()])[0]

    def save(self, path: str) -> None:
        self._all("save", path)

    def load(self, path: str) -> None:
        self._all("load", path)

    def kill(self) -> None:
        import ray
        for a in self.ranks:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
        if self.placement is not None:
            from rollout_service.ray_placement import release
            release(self.placement)
            self.placement = None

    def close(self) -> None:
        import ray
        if self._killed:  # by _gather: a rank was lost, or ranks were stuck behind another's error
            return
        try:
            ray.get([a.close.remote() for a in self.ranks], timeout=60)
        except Exception:  # a dead or hung rank: killed below either way
            pass
        self.kill()
