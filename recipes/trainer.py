"""FSDP2 policy training on Ray: one actor per trainer rank, one torch.distributed process group.

Each rank holds float32 master weights sharded with `fully_shard` (every decoder layer, then the
root); forwards run on bf16 copies (MixedPrecisionPolicy) through the canonical forward installed by
`trainer_patch.patch_model`, so its log-probs are the rollout engine's, bit for bit. Ray is imported
only where used, so a TrainerRank also runs in plain torch.distributed processes.
"""
from __future__ import annotations

import math
import os
import socket
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import kernels as K
from rollout_service.service.ray_cluster import actor_gpu_ids
from trainer_patch import (
    checkpoint_activations,
    patch_model,
    stock_token_logprobs,
    token_logprobs,
)

from .batch import STEP_INPUTS, real_tokens
from .config import TrainerConfig
from .gpu_clocks import ClockSampler, gpu_id
from .grpo_loss import clipped_pg_loss, rollout_correction
from .lora import adapter_push, adapter_state, add_lora, save_trained_adapter
from .memory_plan import (
    MemoryPlan,
    TrainerOutOfMemory,
    device_memory,
    out_of_memory_message,
)
from .step_memory import allocator_counts, drop_failed_step, release_cache_for_engine
from .step_stats import RatioSpread, rollout_agreement, routing_out
from .weight_push import RankWeightPush
from .weight_versions import WeightVersions


def _ray_node() -> dict | None:
    """The Ray node this rank runs on ({"node_id", "ip"}), named when the rank is lost; None outside Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


class TrainerRank:
    """One rank. Created by TrainerGroup as a Ray actor; every method except `address` is collective."""

    def __init__(self, rank: int, world_size: int, cfg: TrainerConfig, temperature: float,
                 numerics: str = "canonical", memory_plan: MemoryPlan | None = None, lora=None, seed: int = 0):
        """memory_plan: the run's (recipes.memory_plan), or None. A CUDA rank checks it against its GPU
        before taking any memory, names it when a step runs out of memory, and gives its cached memory
        back before an engine sleeping on its GPU wakes (MemoryPlan.engine_wakes_after_step).
        lora: a LoraSection (recipes.config.model): train a PEFT adapter on the frozen base; None: the
        whole model. seed: the run's (where the adapter starts)."""
        self.rank, self.world, self.cfg, self.numerics = rank, world_size, cfg, numerics
        self.lora, self.seed = lora, seed
        self.memory_plan = memory_plan
        self.temperature = float(temperature) if temperature > 0 else 1.0
        torch.set_num_threads(cfg.placement.torch_threads or 1)
        # The patched root returns a view of the logits; nothing here modifies it in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        self.model = self.opt = None
        self._versions = WeightVersions()  # this rank's shards of older weight versions (keep_version)
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
        if self.lora is None:  # float32 master weights (the canonical forward reads no buffers)
            for p in model.parameters():
                p.data = p.data.float()
        if self.numerics == "canonical":
            patch_model(model)
        else:  # the stock arm: the model's own forward with its best stock attention
            model.config._attn_implementation = "sdpa"
        if self.lora is not None:  # a frozen bf16 base, a float32 adapter (recipes/lora.py)
            add_lora(model, self.lora.peft_config(), self.seed)
        if self.cfg.batching.activation_checkpointing:
            checkpoint_activations(model, self.cfg.batching.checkpoint_every)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.train()
        self.model = model
        optimizer = self.cfg.optimizer
        trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapter's alone
        self.opt = torch.optim.AdamW(trained, lr=optimizer.lr, betas=tuple(optimizer.betas),
                                     weight_decay=optimizer.weight_decay)
        self.weight_push = RankWeightPush(self.rank, self.world, self.cfg, self.device, model, self.full_state_dict,
                                          adapter_push(self.lora))
        canonical = K.canonical_config(self.device) if self.numerics == "canonical" else None
        self.num_params = sum(p.numel() for p in model.parameters())
        return {"num_params": self.num_params, "canonical": canonical,
                "gpu_ids": actor_gpu_ids(), "node": _ray_node()}

    # -- training --------------------------------------------------------------------------------

    def _logprobs(self, mb: dict, routing: list | None = None) -> torch.Tensor:
        """Log-probs of a micro-batch, padded rows or one packed row (recipes.batch)."""
        ids = mb["input_ids"].to(self.device)
        layout = ({"position_ids": mb["position_ids"].to(self.device)} if "position_ids" in mb
                  else {"attention_mask": mb["attention_mask"].to(self.device)})
        if self.numerics == "stock":
            return stock_token_logprobs(self.model, ids, temperature=self.temperature, routing=routing,
                                        **{"attention_mask": None, **layout})
        return token_logprobs(self.model, ids, temperature=self.temperature, routing=routing, **layout)

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
            with ClockSampler(gpu_id(self.device)) as clocks:  # is the GPU at full clocks while it trains?
                result = self._step_or_out_of_memory(minibatches, tokens_per_mini, stale_versions)
        except BaseException as e:
            self.weight_push.decline_armed(f"the train step before it failed: {e!r}")
            raise
        self._train_failed = False
        result["gpu_clocks"] = clocks.summary()
        return result

    def _step_or_out_of_memory(self, minibatches: list[list[dict]], tokens_per_mini: list[int],
                               stale_versions: tuple[int, ...]) -> dict:
        """_train_step; one that runs out of device memory raises TrainerOutOfMemory, once the rank has
        dropped what the step held (recipes.step_memory.drop_failed_step), so that it can step again."""
        self._optimizer_steps = 0
        try:
            return self._train_step(minibatches, tokens_per_mini, stale_versions)
        except torch.OutOfMemoryError as e:
            message = out_of_memory_message(e, self.memory_plan, self._optimizer_steps, len(minibatches))
        # Rule: the step's memory is dropped only here, after the except block: the caught error's
        # traceback holds the step's frames, and with them its activations, until that block ends (so the
        # error raised here is not chained to it either).
        drop_failed_step(self.model, self.opt, self.device)
        raise TrainerOutOfMemory(message)

    def _staged(self, minibatches: list[list[dict]]) -> list[list[dict]]:
        """The tensors a step's forwards and loss read, on the device, copied before its first forward. Rule:
        no host-to-device copy between micro-batches: a blocking `.to(device)` returns only once the stream
        has run everything queued before it, so each would hold the host until the last backward ends."""
        return [[{key: mb[key].to(self.device) for key in STEP_INPUTS if key in mb} for mb in micros]
                for micros in minibatches]

    def _train_step(self, minibatches: list[list[dict]], tokens_per_mini: list[int],
                    stale_versions: tuple[int, ...]) -> dict:
        cfg, start = self.cfg, time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            counts_before = allocator_counts(self.device)
        behaviour = self._versions.stale_logprobs(self.model, minibatches, stale_versions, self._logprobs,
                                                  self.device)
        # Rule: nothing is read back from the device per micro-batch, so the host queues the next forward
        # while the last backward runs. Each forward's log-probs are compared with the rollouts (`scored`)
        # and the step's sums (`totals`) read once, after the step.
        scored, pre, staged = [], None, self._staged(minibatches)
        if len(minibatches) > 1 or cfg.loss.old_logprobs == "recompute":
            pre = []
            with torch.no_grad():
                for m, micros in enumerate(minibatches):
                    pre.append([])
                    for j, mb in enumerate(micros):
                        routing = routing_out(mb)
                        pre[-1].append(self._logprobs(staged[m][j], routing))
                        scored.append((mb, pre[-1][-1], routing, behaviour.get((m, j))))
        # loss, clipped tokens, -entropy, kept tokens: float64 sums in micro-batch order, as Python's floats would be
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)
        grad_norms, seq_tokens, ratios = [], 0, RatioSpread()
        for m, micros in enumerate(minibatches):
            scale = self.world / max(tokens_per_mini[m], 1)  # FSDP averages gradients over ranks
            for j, mb in enumerate(micros):
                routing = routing_out(mb) if pre is None else None
                on_device = staged[m][j]
                logp = self._logprobs(on_device, routing)
                mask = on_device["loss_mask"]
                if pre is None:
                    scored.append((mb, logp.detach(), routing, behaviour.get((m, j))))
                if cfg.loss.old_logprobs == "rollout":
                    old = on_device["rollout_logprobs"]
                else:
                    old = pre[m][j] if pre is not None else logp.detach()
                ratios.add(logp.detach(), old, mask)
                weights = rollout_correction(cfg.loss.rollout_correction, old, on_device["rollout_logprobs"],
                                             cfg.loss.rollout_correction_cap)
                loss_sum, clipped = clipped_pg_loss(logp, old, on_device["advantages"], mask,
                                                    cfg.loss.clip_low, cfg.loss.clip_high, weights)
                # the sampled tokens' mean -log p estimates the policy's entropy (they were drawn from it)
                neg_entropy = torch.where(mask.bool(), logp.detach().double(), 0.0).sum()
                kept = mask.bool().sum() if weights is None else ((weights > 0) & mask.bool()).sum()
                (loss_sum * scale).backward()
                totals += torch.stack([loss_sum.detach().double(), clipped.double(), -neg_entropy, kept.double()])
                seq_tokens += real_tokens(mb)
            if m == len(minibatches) - 1:  # the step's last backward has run
                release_cache_for_engine(self.device, self.memory_plan)
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
        allocs, retries = ([a - b for a, b in zip(allocator_counts(self.device), counts_before)]
                           if self.device.type == "cuda" else (0, 0))
        loss_total, clipped_total, entropy_total, kept_total = totals.tolist()
        agreement = [rollout_agreement(*forward) for forward in scored]
        return {"agreement": agreement, "loss_sum": loss_total, "clipped_tokens": clipped_total,
                "entropy_sum": entropy_total, "kept_tokens": kept_total,
                "grad_norm": grad_norms, "tokens": seq_tokens, "ratio": ratios.summary(),
                "seconds": time.perf_counter() - start, "peak_memory_bytes": peak, "device_allocs": allocs,
                "alloc_retries": retries,
                "num_params": self.num_params}

    # -- weight versions (asynchronous steps) ------------------------------------------------------

    def keep_version(self, version: int, keep: int) -> None:
        """Remember this rank's shards of the current weights as `version` (the pool's weight version
        after the push that carried them); only the newest `keep` versions are kept."""
        self._versions.keep(self.model, version, keep)

    def _clip_grads(self) -> float:
        max_norm = self.cfg.optimizer.max_grad_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return float(norm)

    # -- weights and checkpoints -----------------------------------------------------------------

    def full_state_dict(self) -> dict | None:
        """bf16 full weights on rank 0 (None elsewhere): what the rollout workers load; with LoRA the
        adapter's tensors alone, by PEFT's names."""
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        if self.lora is not None:
            return adapter_state(sd)
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
        """Sharded model + optimizer checkpoint (torch.distributed.checkpoint) under `path`; with LoRA also the
        adapter as a PEFT checkpoint in `path`/adapter (PeftModel.from_pretrained and load_adapter read it)."""
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        adapter = self.full_state_dict() if self.lora is not None else None  # collective
        if adapter is not None:  # rank 0
            save_trained_adapter(self.lora, adapter, os.path.join(path, "adapter"))

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
