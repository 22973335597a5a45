"""What a trainer rank holds in a step, by kind: bytes per parameter, per token and per tensor of the
model's shape, and the tokens of a step's largest micro-batch (recipes.memory_plan adds them up)."""
from __future__ import annotations

import math

from rollout_service.service.weight_sync import stages_whole

from .config import RecipeConfig
from .model_shape import BF16, FP32, ModelShape

GiB = 1 << 30

# -- what a parameter costs a rank (bytes per parameter, sharded over trainer.num_ranks by FSDP2) ---
MASTER_WEIGHT_BYTES = FP32  # the float32 master weights (TrainerRank.setup)
GRADIENT_BYTES = FP32  # their gradients, reduce-scattered in float32 (MixedPrecisionPolicy reduce_dtype)
ADAM_STATE_BYTES = 2 * FP32  # AdamW's exp_avg and exp_avg_sq
OPTIMIZER_STEP_BYTES = FP32  # torch's foreach AdamW: one float32 temporary per parameter (the denominator)
# trainer.batching.activation_checkpointing (trainer_patch.checkpoint_activations, non-reentrant
# checkpoint per layer): a layer keeps its input [hidden] alone; its full activations exist for one layer at a time,
# recomputed in the backward.
CHECKPOINTED_HIDDEN_PER_LAYER = 1
# The backward's working set: the gradients of the layer being differentiated, about as large as what it
# saved (the grads of gate, up and their product, of q, k, v; the norms' float32 temporaries).
BACKWARD_WORKSPACE_LAYERS = 1

# -- FSDP2's gathered weights and unsharded gradients ------------------------------------------------------
# A layer's bf16 weights gathered while the next one is prefetched; the root (embedding, final norm, lm head)
# stays gathered from its forward to its backward (reshard_after_forward is off for the root).
GATHERED_LAYERS = 2
# In the backward, a layer's unsharded gradient in bf16 and its float32 copy for the reduce-scatter, for the
# layer being reduced and the one behind it.
UNSHARDED_GRADIENT_BYTES = BF16 + FP32

# -- the lm head (kernels.head_token_logprobs scores HEAD_CHUNK_ROWS rows at a time) ----------------------
# At most three float32 [rows, vocab] tensors of a chunk at once, in the forward: the logits, the scaled
# logits and their log-softmax. The backward holds less: a chunk's bf16 logits, overwritten by their
# gradient (kernels.backward._HeadTokenLogprobs).
LOGITS_CHUNK_BYTES = 3 * FP32
# The lm head weight's gradient [vocab, hidden], at the start of the backward when every activation is
# kept: a float32 accumulator that each chunk's GEMM adds into (kernels.backward.accumulate_product).
HEAD_GRADIENT_BYTES = FP32

# -- what is not a tensor of the model ----------------------------------------------------------------------
RUNTIME_BYTES = 2 * GiB  # the CUDA context, cuBLAS and NCCL workspaces
ALLOCATOR_SLACK = 0.05  # the caching allocator's rounding and fragmentation, a share of every other term


def micro_batch_tokens(cfg: RecipeConfig, longest_prompt: int) -> int:
    """Tokens of a rank's largest micro-batch: trainer.batching.max_tokens_per_micro_batch when > 0, else
    micro_batch_size (or all of a rank's rows of a mini-batch) x the longest sequence (the longest prompt +
    rollout.max_tokens)."""
    t = cfg.trainer.batching
    if t.max_tokens_per_micro_batch > 0:
        return t.max_tokens_per_micro_batch
    rows = math.ceil(cfg.train.prompts_per_step * cfg.rollout.n / t.mini_batches / cfg.trainer.num_ranks)
    if t.micro_batch_size > 0:
        rows = min(rows, t.micro_batch_size)
    return rows * longest_sequence(cfg, longest_prompt)


def longest_sequence(cfg: RecipeConfig, longest_prompt: int) -> int:
    return longest_prompt + cfg.rollout.max_tokens

def push_stage_bytes(cfg: RecipeConfig, model: ModelShape) -> int:
    """The bf16 stage of a bucketed push that rank 0 keeps between pushes (weight_sync.SenderStage), when the
    weights fit trainer.weight_push.stage_mb; 0 for object-store pushes, whose state dict goes to the host."""
    if cfg.trainer.weight_push.transport == "object_store":
        return 0
    lora = cfg.model.lora  # a LoRA push carries the adapter alone
    numel = model.state_dict_numel if lora is None else model.lora_params(lora.r, lora.targets())
    return BF16 * numel if stages_whole(numel, cfg.trainer.weight_push.stage_mb << 20) else 0


def push_bucket_bytes(cfg: RecipeConfig, model: ModelShape) -> int:
    """A streamed push's bucket on rank 0, held while it pushes (not between pushes)."""
    if cfg.trainer.weight_push.transport == "object_store" or push_stage_bytes(cfg, model):
        return 0
    return cfg.trainer.weight_push.bucket_mb << 20

def gib(n: int | float) -> str:
    return f"{n / GiB:.1f}"
