"""FSDP2 policy training on Ray: one actor per trainer rank, one torch.distributed process group.

Each rank holds float32 master weights sharded with `fully_shard` (every decoder layer, then the
root); forwards run on bf16 copies (MixedPrecisionPolicy) through the canonical forward installed by
`trainer_patch.patch_model`, so its log-probs are the rollout engine's, bit for bit. Ray is imported
only where used, so a TrainerRank also runs in plain torch.distributed processes.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import socket
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import kernels as K
from rollout_service.service.ray_cluster import actor_gpu_ids
from trainer_patch import checkpoint_activations, patch_model, stock_token_logprobs, token_logprobs

from .batch import real_tokens
from .config import TrainerConfig
from .grpo_loss import clipped_pg_loss
from .memory_plan import MemoryPlan, TrainerOutOfMemory, device_memory, out_of_memory_message
from .metrics import logprob_agreement, routing_agreement
from .weight_push import RankWeightPush


class TrainerRank:
    """One rank. Created by TrainerGroup as a Ray actor; every method except `address` is collective."""

    def __init__(self, rank: int, world_size: int, cfg: TrainerConfig, temperature: float,
                 numerics: str = "canonical", memory_plan: MemoryPlan | None = None):
        """memory_plan: the run's (recipes.memory_plan), or None. A CUDA rank checks it against its GPU
        before taking any memory, names it when a step runs out of memory, and gives its cached memory
        back before an engine sleeping on its GPU wakes (MemoryPlan.engine_wakes_after_step)."""
        self.rank, self.world, self.cfg, self.numerics = rank, world_size, cfg, numerics
        self.memory_plan = memory_plan
        self.temperature = float(temperature) if temperature > 0 else 1.0
        torch.set_num_threads(cfg.torch_threads or 1)
        # The patched root returns a view of the logits; nothing here modifies it in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        self.model = self.opt = None
        self._versions: dict[int, list[torch.Tensor]] = {}  # weight version -> this rank's shards (keep_version)
        self.weight_push: RankWeightPush | None = None  # made by setup, with the model
        self._train_failed = False  # the last train step raised: a push queued behind it is not sent
        self._optimizer_steps = 0  # optimizer steps applied in the train step under way

    def address(self) -> tuple[str, int]:
        import ray
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, model: torch.nn.Module) -> dict:

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        if self.cfg.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this actor's GPU as device 0
            self.device, backend = torch.device("cuda", 0), "nccl"
            if self.memory_plan is not None:  # refused before this rank takes any memory
                self.memory_plan = self.memory_plan.on_gpu(device_memory(0))
                self.memory_plan.check()
        else:
            self.device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world)
        mesh = init_device_mesh(self.device.type, (self.world,))
        model = model.to(self.device)
        for p in model.parameters():  # float32 master weights (the canonical forward reads no buffers)
            p.data = p.data.float()
        if self.numerics == "canonical":
            patch_model(model)
        else:  # the stock arm: the model's own forward with its best stock attention
            model.config._attn_implementation = "sdpa"
        if self.cfg.activation_checkpointing:
            checkpoint_activations(model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.train()
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                     weight_decay=self.cfg.weight_decay)
        self.weight_push = RankWeightPush(self.rank, self.world, self.cfg, self.device, model, self.full_state_dict)
        canonical = K.canonical_config(self.device) if self.numerics == "canonical" else None
        self.num_params = sum(p.numel() for p in model.parameters())
        return {"num_params": self.num_params, "canonical": canonical,
                "gpu_ids": actor_gpu_ids()}

    # -- training --------------------------------------------------------------------------------

    def _logprobs(self, mb: dict, routing: list | None = None) -> torch.Tensor:
        """Log-probs of a micro-batch, padded rows or one packed row (recipes.batch)."""
        ids = mb["input_ids"].to(self.device)
        layout = ({"position_ids": mb["position_ids"].to(self.device)} if "position_ids" in mb
                  else {"attention_mask": mb["attention_mask"].to(self.device)})
        if self.numerics == "stock":
            return stock_token_logprobs(self.model, ids, temperature=self.temperature,
                                        **{"attention_mask": None, **layout})
        return token_logprobs(self.model, ids, temperature=self.temperature, routing=routing, **layout)

    @staticmethod
    def _routing_out(mb: dict) -> list | None:
        """A list for the forward's MoE routing when the rollouts recorded theirs, else None."""
        return [] if "rollout_routed_experts" in mb else None

    @staticmethod
    def _agreement(mb: dict, logp: torch.Tensor, routing: list | None, behaviour=None) -> dict:
        """Log-prob (and, for MoE rollouts, routing) agreement of one forward with the rollouts; rows of an
        older weight version from `behaviour` (log-probs, rows), that version's forward."""
        if behaviour is not None:
            stale_logp, tokens = behaviour
            logp = torch.where(tokens, stale_logp, logp)
        part = logprob_agreement(mb["rollout_logprobs"], logp.cpu(), mb["loss_mask"])
        if routing is not None:  # per layer [B, T, k] -> [B, T-1, layers, k], aligned like the log-probs
            train = torch.stack(routing, dim=2)[:, :-1].cpu()
            part.update(routing_agreement(mb["rollout_routed_experts"], train, mb["loss_mask"]))
        return part

    def train_step(self, minibatches: list[list[dict]], tokens_per_mini: list[int],
                   stale_versions: tuple[int, ...] = (), arm=None) -> dict:
        """One optimizer step per mini-batch. Log-prob and routing agreement are measured before any
        update, from the forward that gives the log-probs (no extra forward). Rows generated with an
        older weight version (stale_versions: every one in the step, the same list on every rank, each
        kept by keep_version) are measured against that version's weights, one extra forward per
        version: the agreement is always with the behaviour policy.

        arm: the pool (its RolloutClient) of the push that follows this step; rank 0 arms it first
        (RankWeightPush.arm)."""
        self._train_failed = True
        if arm is not None:
            self.weight_push.arm(arm)
        try:
            result = self._step_or_out_of_memory(minibatches, tokens_per_mini, stale_versions)
        except BaseException as e:
            self.weight_push.decline_armed(f"the train step before it failed: {e!r}")
            raise
        self._train_failed = False
        return result

    def _step_or_out_of_memory(self, minibatches: list[list[dict]], tokens_per_mini: list[int],
                               stale_versions: tuple[int, ...]) -> dict:
        """_train_step; one that runs out of device memory raises TrainerOutOfMemory, once the rank has
        dropped what the step held (_drop_failed_step), so that it can step again."""
        self._optimizer_steps = 0
        try:
            return self._train_step(minibatches, tokens_per_mini, stale_versions)
        except torch.OutOfMemoryError as e:
            message = out_of_memory_message(e, self.memory_plan, self._optimizer_steps, len(minibatches))
        # Rule: the step's memory is dropped only here, after the except block: the caught error's
        # traceback holds the step's frames, and with them its activations, until that block ends (so the
        # error raised here is not chained to it either).
        self._drop_failed_step()
        raise TrainerOutOfMemory(message)

    def _drop_failed_step(self) -> None:
        """What a failed step leaves is dropped: FSDP2's iteration state (reset_iter_state waits for the
        collectives in flight and reshards every layer), the partial gradients (the step is lost), and on
        CUDA the allocator's cache."""
        reset = getattr(self.model, "reset_iter_state", None)
        if reset is not None:
            reset()
        else:  # a torch without FSDPModule.reset_iter_state: every gathered parameter dropped at least
            self._reshard()
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _train_step(self, minibatches: list[list[dict]], tokens_per_mini: list[int],
                    stale_versions: tuple[int, ...]) -> dict:
        cfg, start = self.cfg, time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        behaviour = self._stale_logprobs(minibatches, stale_versions)
        agreement, pre = [], None
        if len(minibatches) > 1 or cfg.old_logprobs == "recompute":
            pre = []
            with torch.no_grad():
                for m, micros in enumerate(minibatches):
                    pre.append([])
                    for j, mb in enumerate(micros):
                        routing = self._routing_out(mb)
                        pre[-1].append(self._logprobs(mb, routing))
                        agreement.append(self._agreement(mb, pre[-1][-1], routing, behaviour.get((m, j))))
        loss_total = clipped_total = 0.0
        grad_norms, seq_tokens, ratios = [], 0, _RatioSpread()
        for m, micros in enumerate(minibatches):
            scale = self.world / max(tokens_per_mini[m], 1)  # FSDP averages gradients over ranks
            for j, mb in enumerate(micros):
                routing = self._routing_out(mb) if pre is None else None
                logp = self._logprobs(mb, routing)
                mask = mb["loss_mask"].to(self.device)
                if pre is None:
                    agreement.append(self._agreement(mb, logp, routing, behaviour.get((m, j))))
                if cfg.old_logprobs == "rollout":
                    old = mb["rollout_logprobs"].to(self.device)
                else:
                    old = pre[m][j] if pre is not None else logp.detach()
                ratios.add(logp.detach(), old, mask)
                loss_sum, clipped = clipped_pg_loss(logp, old, mb["advantages"].to(self.device), mask,
                                                    cfg.clip_low, cfg.clip_high)
                (loss_sum * scale).backward()
                loss_total += loss_sum.item()
                clipped_total += float(clipped)
                seq_tokens += real_tokens(mb)
            if m == len(minibatches) - 1:  # the step's last backward has run
                self._release_cache_for_engine()
                self.weight_push.wake_engines()
            grad_norms.append(self._clip_grads())
            self.opt.step()
            self._optimizer_steps += 1
            self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            # Rule: a step ends when its optimizer step has run on the device. The host is ahead of the
            # device by the whole optimizer step (it reads nothing back after it); without this wait that
            # time would be counted in whatever reads the weights next, the weight push.
            torch.cuda.current_stream(self.device).synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        return {"agreement": agreement, "loss_sum": loss_total, "clipped_tokens": clipped_total,
                "grad_norm": grad_norms, "tokens": seq_tokens, "ratio": ratios.summary(),
                "seconds": time.perf_counter() - start, "peak_memory_bytes": peak,
                "num_params": self.num_params}

    # -- weight versions (asynchronous steps) ------------------------------------------------------

    def keep_version(self, version: int, keep: int) -> None:
        """Remember this rank's shards of the current weights as `version` (the pool's weight version
        after the push that carried them); only the newest `keep` versions are kept."""
        with torch.no_grad():
            self._versions[version] = [_local(p).detach().clone() for p in self.model.parameters()]
        for old in sorted(self._versions)[:-keep]:
            del self._versions[old]

    @contextlib.contextmanager
    def _weights_of(self, version: int):
        """The model holds `version`'s weights inside the block, its own again after it."""
        if version not in self._versions:
            raise KeyError(f"weight version {version} is not kept (kept: {sorted(self._versions)})")
        params = [_local(p) for p in self.model.parameters()]
        with torch.no_grad():
            own = [p.detach().clone() for p in params]
            self._reshard()
            for p, kept in zip(params, self._versions[version]):
                p.copy_(kept)
        try:
            yield
        finally:
            with torch.no_grad():
                self._reshard()
                for p, mine in zip(params, own):
                    p.copy_(mine)

    def _reshard(self) -> None:
        """Drop every unsharded parameter. Rule: before the shards change under FSDP2, since the root
        keeps its all-gathered bf16 parameters after a forward (reshard_after_forward is off for the
        root) and the next forward would reuse them instead of gathering the new shards."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _stale_logprobs(self, minibatches: list[list[dict]], versions) -> dict:
        """{(mini-batch, micro-batch): (log-probs, tokens)}: the tokens of a stale version scored with that
        version's weights over their whole prefix (a rollout switched in flight has tokens of two). Every
        rank runs one forward per micro-batch per version, in step (FSDP's gathers pair up), whether or
        not its own tokens include that version."""
        logps, rows = {}, {}
        for version in versions:
            with self._weights_of(version), torch.no_grad():
                for m, micros in enumerate(minibatches):
                    for j, mb in enumerate(micros):
                        mine = (mb["weight_version"] == version).to(self.device)  # [B, T-1] tokens
                        if "rollout_routed_experts" in mb and bool(mine.any()):
                            raise NotImplementedError("routing agreement against an older weight version")
                        logp, key = self._logprobs(mb), (m, j)
                        if key in logps:
                            logps[key], rows[key] = torch.where(mine, logp, logps[key]), rows[key] | mine
                        else:
                            logps[key], rows[key] = logp, mine
        return {key: (logps[key], rows[key]) for key in logps}

    def _release_cache_for_engine(self) -> None:
        """Rule: a CUDA rank gives its cached memory back (torch.cuda.empty_cache) before a rollout engine
        sleeping on its GPU wakes (colocated placement). The last backward has freed the activations, but
        PyTorch's caching allocator keeps their blocks for this process, where the waking engine, another
        process, cannot map them. Where no engine wakes on the GPU the cache is kept: the next step reuses
        it without allocating from the device again."""
        if self.device.type == "cuda" and self.memory_plan is not None and self.memory_plan.engine_wakes_after_step:
            torch.cuda.empty_cache()

    def _clip_grads(self) -> float:
        max_norm = self.cfg.max_grad_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return float(norm)

    # -- weights and checkpoints -----------------------------------------------------------------

    def full_state_dict(self) -> dict | None:
        """bf16 full weights on rank 0 (None elsewhere): what the rollout workers load."""
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        return {k: v.to(torch.bfloat16) for k, v in sd.items()}

    def push_weights(self, pool, overlap: bool = False, after_train_step: bool = False) -> dict | None:
        """Load the weights into the rollout pool `pool` (its RolloutClient; rank 0 sends; every rank takes part in the gathers);
        returns, on rank 0, both digests, the transport, the seconds it took and those of its phases
        (connect: the transport chosen; bucketed pushes: check, begin, send, finish).

        object_store: the full bf16 state dict on rank 0's host, through ray.put. broadcast / ipc
        (rollout_service.service.weight_sync): one parameter gathered at a time on the device, into a
        stage of the whole push on rank 0 (once) or bucket by bucket (twice: first for every check,
        then to send); either way every check (finite, fingerprints, the pool's names and shapes)
        passes before anything reaches a worker.

        overlap (a staged push only): return once every check has passed and the pool's workers wait for
        the push ("sending": True, no pool digest yet); rank 0 sends from the stage in a thread of its
        own while the caller trains on, and finish_push() gives the verdict. The stage is a copy, so the
        next optimizer step cannot touch what is being sent.

        after_train_step: the call was queued behind a train step (TrainerGroup.train_step's push_to),
        and is refused if that step failed. A push armed by the step is sent here."""
        if after_train_step and self._train_failed:
            raise RuntimeError("no weights pushed: the train step before this push failed")
        return self.weight_push.push(pool, overlap)

    def finish_push(self) -> dict | None:
        """The verdict of a push still sending (push_weights overlap), once it has landed: both digests and
        the seconds of its send and finish, which ran behind the caller's work; None when none was."""
        return self.weight_push.finish()

    def save(self, path: str) -> None:
        """Sharded model + optimizer checkpoint (torch.distributed.checkpoint) under `path`."""
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    def load(self, path: str) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.weight_push.forget_sources()

    def close(self) -> None:
        if self.weight_push is not None:  # an armed push's workers go back to serving now, not at its timeout
            self.weight_push.decline_armed("the trainer closed")
        if dist.is_initialized():
            dist.destroy_process_group()


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (a view: writing it writes the parameter)."""
    return param.to_local() if hasattr(param, "to_local") else param


class _RatioSpread:
    """The importance ratio exp(log-prob - old log-prob) over a step's loss tokens: min, mean, max. Kept on
    the device and read once per step (no host sync per micro-batch)."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []  # per micro-batch: [min, max, sum, count]

    def add(self, logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> None:
        ratio, mask = (logp - old).exp().double(), mask.bool()
        self.parts.append(torch.stack([torch.where(mask, ratio, math.inf).min(),
                                       torch.where(mask, ratio, -math.inf).max(),
                                       torch.where(mask, ratio, 0.0).sum(), mask.sum().double()]))

    def summary(self) -> dict:
        if not self.parts:
            return {"min": math.inf, "max": -math.inf, "sum": 0.0, "count": 0}
        parts = torch.stack(self.parts).cpu()
        return {"min": float(parts[:, 0].min()), "max": float(parts[:, 1].max()), "sum": float(parts[:, 2].sum()),
                "count": int(parts[:, 3].sum())}


class TrainerGroup:
    """Driver-side handle: starts the ranks, forms the process group, fans calls out to all ranks."""

    def __init__(self, cfg: TrainerConfig, model: torch.nn.Module, temperature: float, numerics: str = "canonical",
                 colocate_with=None, first_bundle: int = 0, memory_plan: MemoryPlan | None = None):
        """colocate_with: a placement group of the caller's whose bundles other actors share: rank r takes
        a share of bundle first_bundle + r. The colocated placement shares bundle r with rollout worker
        r; two jobs taking steps in turns on the same GPUs share each bundle (bench.grpo_step
        --interleave; a split job's ranks come after its workers' bundles). Without it, GPU ranks
        reserve a group of their own. `gpu_ids`: the GPUs Ray gave each rank, in rank order.
        memory_plan: the run's (recipes.memory_plan), given to every rank (TrainerRank)."""
        import ray

        self.world = cfg.num_ranks
        self._left_sending = False  # the last push returned while rank 0 sends it (push_weights overlap)
        self._queued_push = None  # (the pool, every rank's push call) queued by train_step
        opts = {"num_cpus": 1, **cfg.resources_per_rank}
        self.placement = None
        per_rank = [dict(opts) for _ in range(self.world)]
        from rollout_service.service.ray_cluster import on_bundle, reserve
        if colocate_with is not None:
            per_rank = [dict(opts, scheduling_strategy=on_bundle(colocate_with, first_bundle + r))
                        for r in range(self.world)]
        elif cfg.device == "cuda":
            opts.setdefault("num_gpus", 1)
            # One node where possible: NCCL stays intra-node and checkpoints land on one disk.
            bundle = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"]}
            self.placement = reserve([bundle] * self.world, cfg.placement_strategy)
            ray.get(self.placement.ready())
            per_rank = [dict(opts, scheduling_strategy=on_bundle(self.placement, r)) for r in range(self.world)]
        actor = ray.remote(TrainerRank)
        self.ranks = [actor.options(**per_rank[r]).remote(r, self.world, cfg, temperature, numerics, memory_plan)
                      for r in range(self.world)]
        try:
            addr, port = ray.get(self.ranks[0].address.remote())
            model_ref = ray.put(model)
            infos = ray.get([a.setup.remote(addr, port, model_ref) for a in self.ranks])
            self.num_params = infos[0]["num_params"]
            self.gpu_ids = [g for info in infos for g in info["gpu_ids"]]
            self.canonical = None if numerics == "stock" else K.check_canonical(
                {f"trainer rank {r}": info["canonical"] for r, info in enumerate(infos)})
        except BaseException:
            self.kill()
            raise

    def _all(self, method: str, *args) -> list:
        import ray
        return ray.get([getattr(a, method).remote(*args) for a in self.ranks])

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
            return ray.get(refs)
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
        import ray
        queued, self._queued_push = self._queued_push, None
        if queued is not None and queued[0] == pool and not overlap:
            result = ray.get(queued[1])[0]
        else:
            if queued is not None:  # a push to another pool, or left sending: the queued one lands first
                ray.get(queued[1])
            result = self._all("push_weights", pool, overlap)[0]
        self._left_sending = result["sending"]
        return result

    def finish_push(self) -> dict | None:
        """TrainerRank.finish_push on rank 0 (it alone sends); no call when no push was left sending."""
        import ray
        if not self._left_sending:
            return None
        self._left_sending = False
        return ray.get(self.ranks[0].finish_push.remote())

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
            from rollout_service.service.ray_cluster import release
            release(self.placement)
            self.placement = None

    def close(self) -> None:
        import ray
        try:
            ray.get([a.close.remote() for a in self.ranks], timeout=60)
        except Exception:  # a dead or hung rank: killed below either way
            pass
        self.kill()
