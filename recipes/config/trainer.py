"""The `trainer` section of the recipe config: the FSDP2 trainer ranks, then one sub-section per concern:
where the ranks run (`placement`), the optimizer (`optimizer`), the loss (`loss`), how a step's rollouts are
cut into forwards (`batching`) and how the new weights reach the rollout workers (`weight_push`)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankPlacementConfig:
    """The `trainer.placement` section: the Ray resources and threads of each rank."""
    resources_per_rank: dict = field(default_factory=lambda: {"num_cpus": 1})
    """Ray actor options of each rank, forwarded; colocated on GPUs: num_gpus, a share below 1. By node or by
    resource: `resources: {<a node's custom resource>: <share>}` (the ranks' bundles keep it)."""
    strategy: str = "PACK"
    """Ray placement-group strategy (PACK | SPREAD | STRICT_PACK | STRICT_SPREAD) of the ranks' group (a
    bundle per rank; placement split) and of the colocated bundles. PACK keeps the ranks on as few nodes
    as fit them; every rank's node must see the run directory (RecipeConfig.output_dir)."""
    torch_threads: int = 1
    """torch.set_num_threads on each rank; 0: 1."""


@dataclass(frozen=True)
class OptimizerConfig:
    """The `trainer.optimizer` section: AdamW and gradient clipping."""
    lr: float = 1e-4
    """AdamW learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas, [beta1, beta2]."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float | None = 1.0
    """Gradient-norm clipping threshold; null or 0: no clipping."""


@dataclass(frozen=True)
class LossConfig:
    """The `trainer.loss` section: the clipped policy-gradient loss and its advantages."""
    clip_low: float = 0.2
    """PPO clip: the probability ratio is clamped below at 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip: the probability ratio is clamped above at 1 + clip_high."""
    old_logprobs: str = "rollout"
    """rollout (the rollouts' own) | recompute (the trainer's, before the update; numerics stock needs it)."""
    scale_advantages: bool = True
    """Divide advantages by the group's std (GRPO); False = mean-centred only."""
    rollout_correction: str = "none"
    """none | tis | token_mask: a correction for rollout log-probs that are not the trainer's, on the ratio of
    the trainer's old log-prob over the rollout's (recipes/grpo_loss.py); needs old_logprobs=recompute."""
    rollout_correction_cap: float = 2.0
    """tis: the ratio's truncation; token_mask: tokens with a ratio outside [1/cap, cap] leave the loss."""


@dataclass(frozen=True)
class BatchingConfig:
    """The `trainer.batching` section: a step's rollouts cut into mini-batches (optimizer steps) and each
    rank's share of those into micro-batches (forwards), and what a forward keeps for its backward."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch, at least 1; train.prompts_per_step must be divisible by it."""
    micro_batch_size: int = 0
    """Sequences per forward on a rank; 0 = all at once. Unused when max_tokens_per_micro_batch is set."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward on a rank (verl's ppo_max_token_len_per_gpu): whole sequences are grouped
    into micro-batches of at most this many tokens (recipes.batch.budget_groups); 0: micro_batch_size rules.
    At least the longest prompt + rollout.max_tokens. Log-probs keep their bits whatever the budget; the
    gradient is a sum over micro-batches, whose order of summation (and so its last bits) follows them."""
    packing: bool = True
    """Each micro-batch's sequences go back to back in one row, positions restarting per sequence (no pad
    token in any matmul or attention); false: right-padded rows. Log-probs are the same bits either way."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (long sequences);
    the forward's values, and so the log-probs, do not change."""
    checkpoint_every: int = 1
    """With activation_checkpointing, only layers 0, N, 2N, ... are checkpointed (torchtitan's selective layer
    option); the others keep their activations and skip the backward's recompute. 1: every layer (least
    memory); larger: faster steps while the memory plan still fits (recipes.memory_plan counts it)."""


@dataclass(frozen=True)
class WeightPushConfig:
    """The `trainer.weight_push` section: how the trained weights reach the rollout workers."""
    transport: str = "auto"
    """How weights reach the workers (rollout_service.service.weight_sync): auto | object_store | broadcast |
    ipc. auto: ipc if they share rank 0's GPU, broadcast if they have GPUs of their own, else object_store."""
    bucket_mb: int = 256
    """Bucket size of broadcast / ipc pushes, in MiB; at least 1."""
    stage_mb: int = 8192
    """Broadcast / ipc pushes whose bf16 weights fit in this many MiB are staged whole on rank 0's device:
    the weights are read once, not twice, and ipc workers take the push in one call. 0 = always in buckets."""
    switch: str = "drain"
    """When a push takes effect for rollouts in flight (rollout_service/service/switch_modes.py): drain |
    finish-then-switch | switch-in-flight (native engines); other than drain needs transport object_store."""
    timeout_s: float = 300.0
    """How long a broadcast or ipc push's workers wait on its sender (WeightPush timeout_s); past it
    they give the push up and restart, keeping the weights they had."""
    arm: bool = True
    """A broadcast or ipc push that follows a train step (synchronous steps) is armed as the step starts:
    the pool drains and its workers wait for it while the ranks train (weight_sync.WeightPush.announce), so
    the pool's begin is off the step's path; a sleeping engine still wakes only once the step's last
    backward has run (asked by rank 0, by ipc). Meanwhile the pool serves no request (the recipe sends
    none then). A step that outlasts half of timeout_s has its armed push declined (the workers go back
    to serving), and the push after it goes unarmed."""


@dataclass(frozen=True)
class TrainerConfig:
    """The `trainer` section: the FSDP2 trainer ranks, and a section per concern of theirs."""
    num_ranks: int = 2
    """Trainer ranks (Ray actors, one torch.distributed process group), at least 1."""
    device: str = "cpu"
    """cpu (gloo) | cuda (NCCL, one GPU per rank)."""
    placement: RankPlacementConfig = field(default_factory=RankPlacementConfig)
    """The `trainer.placement` section: each rank's Ray resources and threads."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The `trainer.optimizer` section: AdamW and gradient clipping."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The `trainer.loss` section: the clipped policy-gradient loss."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """The `trainer.batching` section: mini- and micro-batches, packing, activation checkpointing."""
    weight_push: WeightPushConfig = field(default_factory=WeightPushConfig)
    """The `trainer.weight_push` section: the transport, buckets, stage, switch mode, timeout and arming."""

    def __getattr__(self, name: str):
        """A key's name from before the sections (e.g. `weight_sync`), read where it now lives, for one
        release (recipes.config.renamed)."""
        from .renamed import RENAMED_KEYS
        new = RENAMED_KEYS.get(f"trainer.{name}")
        if new is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"TrainerConfig.{name} is deprecated; read {new.removeprefix('trainer.')}",
                      DeprecationWarning, stacklevel=2)
        value = self
        for part in new.split(".")[1:]:
            value = getattr(value, part)
        return value
