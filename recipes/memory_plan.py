"""Memory is planned, not discovered: an estimate of one GPU trainer rank's memory in a GRPO run, checked
against the rank's GPU before anything long starts, and named again when a step still runs out of it.

    plan = plan_memory(cfg, model.config, longest_prompt=128, gpu=GpuMemory(141 * GiB, "a stated GPU"))
    plan.check()          # MemoryPlanRefused (a ConfigError): every term, the total, the GPU, the knobs
    print(plan.report())

The estimate is for rank 0, the largest (it also holds the weight push's stage), at two moments of a step:

- training, at the backward of the largest micro-batch: fp32 master weights, fp32 gradients and AdamW's
  two fp32 states, all sharded over trainer.num_ranks by FSDP2; the bf16 weights FSDP2 has gathered; a
  layer's unsharded gradients on their way to the reduce-scatter; the activations autograd keeps (every
  layer's, or with trainer.activation_checkpointing each layer's input and one layer's); the backward's
  working set; one chunk of the lm head's logits; the lm head weight's gradient; the weight push's stage;
  on a GPU shared with a rollout engine (placement colocated), what the engine holds meanwhile; the CUDA
  runtime and allocator slack.
- the engine's wake (colocated, the engine asleep while the rank trains): after the last backward the
  rank's sharded states, the optimizer step's temporaries and the stage, next to the engine's whole share.

It is meant to err on the large side, not to be exact. Left out: fragmentation beyond ALLOCATOR_SLACK,
the padding of padded rows (trainer.packing false) beyond the token budget, other processes on the GPU.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch

from kernels.logprobs import HEAD_CHUNK_ROWS
from rollout_service.service.weight_sync import stages_whole

from .config import ConfigError, RecipeConfig, TrainerConfig

GiB = 1 << 30
FP32, BF16 = 4, 2

# -- what a parameter costs a rank (bytes per parameter, sharded over trainer.num_ranks by FSDP2) -----------
MASTER_WEIGHT_BYTES = FP32  # the float32 master weights (TrainerRank.setup)
GRADIENT_BYTES = FP32  # their gradients, reduce-scattered in float32 (MixedPrecisionPolicy reduce_dtype)
ADAM_STATE_BYTES = 2 * FP32  # AdamW's exp_avg and exp_avg_sq
OPTIMIZER_STEP_BYTES = FP32  # torch's foreach AdamW: one float32 temporary per parameter (the denominator)

# -- activations autograd keeps, per token -----------------------------------------------------------------
# Counted in kernels/forward.py decoder_layer_forward and the autograd Functions of kernels/backward.py that
# it calls with gradients on (every tensor bf16; the weights they save are FSDP2's gathered parameters,
# whose storage FSDP2 frees after the layer, so they are not activations):
#   rms_norm of the layer's input (_CanonicalRmsNorm)       saves its input x            [hidden]
#   q, k, v projections (_CanonicalLinear)                  save the normed input        [hidden] (one tensor)
#   q_norm, k_norm (Qwen3 only, _CanonicalRmsNorm)          save q and k before the norm [q], [kv]
#   rotary_qk (_CanonicalRotaryQK)                          saves cos, sin only (shared by every layer)
#   attention (_CanonicalAttention)                         saves rotated q, k and v     [q], [kv], [kv]
#   o_proj (_CanonicalLinear)                               saves the attention output   [q]
#   add_rms_norm after attention (_CanonicalAddRmsNorm)     saves the residual sum       [hidden]
#   gate and up projections (_CanonicalLinear)              save the normed input        [hidden] (one tensor)
#   silu_mul (_CanonicalSiluMul)                            saves gate and up            [inter], [inter]
#   down_proj (_CanonicalLinear)                            saves their product          [inter]
#   the residual add (_CanonicalAdd)                        saves nothing
# where q = heads x head_dim, kv = kv_heads x head_dim, inter = intermediate_size.
SAVED_HIDDEN_PER_LAYER = 4
SAVED_QUERY_PER_LAYER = 2  # + 1 with q_norm
SAVED_KV_PER_LAYER = 2  # + 1 with k_norm
SAVED_INTERMEDIATE_PER_LAYER = 3
# MoE layers (kernels/moe.py experts_loop), per expert a token is routed to: gate and up, their contiguous
# copies and their product [moe_intermediate] each; the token's gathered input row and the expert's output
# (bf16) and its weighted float32 contribution [hidden]: 2 + 2 + 4 bytes.
SAVED_MOE_INTERMEDIATE_PER_EXPERT = 5
SAVED_MOE_HIDDEN_BYTES_PER_EXPERT = BF16 + BF16 + FP32
# After the last layer (trainer_patch's head): the final norm's input and the scored rows
# hidden[:, :-1][where] that kernels.head_token_logprobs saves, [hidden] each.
SAVED_HIDDEN_AFTER_LAYERS = 2
# The float32 rotary rows, cos and sin [head_dim] per token: one pair for all layers.
ROTARY_BYTES_PER_HEAD_DIM = 2 * FP32
# trainer.activation_checkpointing (trainer_patch.checkpoint_activations, non-reentrant checkpoint per
# layer): a layer keeps its input [hidden] alone; its full activations exist for one layer at a time,
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
# At most three float32 [rows, vocab] tensors of a chunk at once: the logits, the scaled logits and their
# log-softmax in the forward; the logits, their softmax and the bf16 gradient with the bf16 GEMM output
# (2 + 2 bytes) in the backward (kernels.backward._HeadTokenLogprobs).
LOGITS_CHUNK_BYTES = 3 * FP32
# The lm head weight's gradient [vocab, hidden], at the start of the backward when every activation is
# kept: a float32 accumulator, each chunk's bf16 GEMM product and that product's float32 copy.
HEAD_GRADIENT_BYTES = FP32 + BF16 + FP32

# -- what is not a tensor of the model ----------------------------------------------------------------------
RUNTIME_BYTES = 2 * GiB  # the CUDA context, cuBLAS and NCCL workspaces
ALLOCATOR_SLACK = 0.05  # the caching allocator's rounding and fragmentation, a share of every other term
# A vLLM engine asleep (level 2) keeps its CUDA context, its CUDA graphs' memory pool and untagged buffers.
ENGINE_ASLEEP_BYTES = 2 * GiB
# An engine sized by bytes (vLLM's kv_cache_memory_bytes, the native engine's kv_cache_tokens) holds its
# bf16 weights, its KV cache and this much more: a forward's activations, CUDA graphs, its CUDA context.
ENGINE_RUNTIME_BYTES = 3 * GiB
# vLLM's share when a native engine drafts with a vLLM instance sized by nothing else
# (rollout_service.vllm.instance.VLLMInstance: sized_options' gpu_share).
VLLM_PROPOSER_SHARE = 0.4

# The largest number of ranks the refusal looks at when it says how many would make the run fit, and the
# multiple of tokens the token budget it advises is rounded down to.
MAX_RANKS_ADVISED = 64
BUDGET_STEP = 128


class MemoryPlanRefused(ConfigError):
    """The run cannot fit the GPU by its memory plan; the message has every term, the total, the GPU's
    memory and the knobs that would make it fit."""


class TrainerOutOfMemory(RuntimeError):
    """A train step ran out of GPU memory. The rank dropped what the step held (its gradients, FSDP2's
    iteration state, the allocator's cache) and can step again; the message names the plan's numbers, where
    the rank had a plan, and the knobs."""


KNOBS = ("trainer.max_tokens_per_micro_batch (fewer tokens per forward and backward), "
         "trainer.activation_checkpointing=true (each layer keeps its input only), trainer.num_ranks (more "
         "GPUs: weights, gradients and AdamW states are sharded over them), rollout.max_tokens (the longest "
         "sequence); on a GPU shared with a rollout engine (placement colocated) also "
         "rollout.engine.gpu_memory_utilization or rollout.engine.vllm_options.kv_cache_memory_bytes (the "
         "engine's share) and rollout.sleep_while_training=true")


@dataclass(frozen=True)
class GpuMemory:
    """A GPU's total memory in bytes, and its name (for messages)."""
    total_bytes: int
    name: str = "GPU"


def device_memory(index: int = 0) -> GpuMemory:
    """This process's CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    return GpuMemory(int(props.total_memory), props.name)


def measure_rank_gpu(trainer: TrainerConfig, placement_group=None, bundle: int = 0,
                     timeout_s: float = 60.0) -> GpuMemory | None:
    """The memory of a GPU like the one a trainer rank will get, read by a one-off Ray task that asks for
    the rank's GPU share (on `bundle` of `placement_group` when the caller has reserved the run's GPUs).
    Its process exits once it has answered (max_calls=1): no CUDA context stays behind on a GPU that a
    rollout engine will size itself against. None when no GPU answered within timeout_s; the ranks then
    check the plan themselves (TrainerRank.setup)."""
    import ray
    from ray.exceptions import GetTimeoutError

    from rollout_service.service.ray_cluster import on_bundle

    options = {"num_cpus": 0, "num_gpus": trainer.resources_per_rank.get("num_gpus", 1)}
    if placement_group is not None:
        options["scheduling_strategy"] = on_bundle(placement_group, bundle)
    ref = ray.remote(max_calls=1)(device_memory).options(**options).remote()  # .options() refuses max_calls
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        ray.cancel(ref, force=True)
        return None


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a decoder the estimate needs, from its Hugging Face config (ModelShape.of)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qk_norm: bool = False  # Qwen3: q_norm and k_norm in every layer
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    experts: int = 0  # MoE layers: experts per layer (0: dense)
    experts_per_token: int = 0
    moe_intermediate: int = 0
    sparse_layers: int = 0  # how many layers are MoE

    @classmethod
    def of(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        experts = getattr(config, "num_experts", 0) or 0
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   intermediate=config.intermediate_size, vocab=config.vocab_size,
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   qk_norm=config.model_type in ("qwen3", "qwen3_moe"),
                   qkv_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")),
                   experts=experts, experts_per_token=getattr(config, "num_experts_per_tok", 0) if experts else 0,
                   moe_intermediate=getattr(config, "moe_intermediate_size", 0) if experts else 0,
                   sparse_layers=_sparse_layers(config) if experts else 0)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_width, self.kv_width
        bias = q + 2 * kv if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return h * q + 2 * h * kv + q * h + bias + norms

    @property
    def dense_layer_params(self) -> int:
        return self.attention_params + 2 * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def sparse_layer_params(self) -> int:
        experts = self.experts * 3 * self.hidden * self.moe_intermediate
        return self.attention_params + 2 * self.hidden + experts + self.hidden * self.experts  # + the router

    @property
    def largest_layer_params(self) -> int:
        return max(self.dense_layer_params, self.sparse_layer_params if self.sparse_layers else 0)

    @property
    def root_params(self) -> int:
        """The embedding, the lm head (unless tied) and the final norm: FSDP2's root group."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def params(self) -> int:
        dense = self.layers - self.sparse_layers
        return dense * self.dense_layer_params + self.sparse_layers * self.sparse_layer_params + self.root_params

    def saved_bytes_per_token(self, sparse: bool) -> int:
        """What autograd keeps per token in one layer (see SAVED_*)."""
        qk = 1 if self.qk_norm else 0
        elements = (SAVED_HIDDEN_PER_LAYER * self.hidden + (SAVED_QUERY_PER_LAYER + qk) * self.q_width
                    + (SAVED_KV_PER_LAYER + qk) * self.kv_width)
        if not sparse:
            return BF16 * (elements + SAVED_INTERMEDIATE_PER_LAYER * self.intermediate)
        k = self.experts_per_token
        return (BF16 * (elements + SAVED_MOE_INTERMEDIATE_PER_EXPERT * k * self.moe_intermediate)
                + SAVED_MOE_HIDDEN_BYTES_PER_EXPERT * k * self.hidden)

    @property
    def largest_layer_saved_bytes_per_token(self) -> int:
        dense = self.saved_bytes_per_token(False) if self.sparse_layers < self.layers else 0
        return max(dense, self.saved_bytes_per_token(True) if self.sparse_layers else 0)

    @property
    def all_layers_saved_bytes_per_token(self) -> int:
        dense = self.layers - self.sparse_layers
        sparse = self.saved_bytes_per_token(True) * self.sparse_layers if self.sparse_layers else 0
        return dense * self.saved_bytes_per_token(False) + sparse

    @property
    def state_dict_numel(self) -> int:
        """Elements of the state dict a push sends: a tied lm head is an entry of its own there."""
        return self.params + (self.vocab * self.hidden if self.tied_embeddings else 0)

    @property
    def kv_bytes_per_token(self) -> int:
        """A bf16 KV cache's bytes per token (every layer's K and V)."""
        return self.layers * 2 * self.kv_width * BF16


def _sparse_layers(config) -> int:
    """Qwen3-MoE: layers whose MLP is the sparse block (decoder_sparse_step, mlp_only_layers)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return sum(1 for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def micro_batch_tokens(cfg: RecipeConfig, longest_prompt: int) -> int:
    """Tokens of a rank's largest micro-batch: trainer.max_tokens_per_micro_batch when > 0, else
    micro_batch_size (or all of a rank's rows of a mini-batch) x the longest sequence (the longest prompt +
    rollout.max_tokens)."""
    t = cfg.trainer
    if t.max_tokens_per_micro_batch > 0:
        return t.max_tokens_per_micro_batch
    rows = math.ceil(cfg.train.prompts_per_step * cfg.rollout.n / t.mini_batches / t.num_ranks)
    if t.micro_batch_size > 0:
        rows = min(rows, t.micro_batch_size)
    return rows * longest_sequence(cfg, longest_prompt)


def longest_sequence(cfg: RecipeConfig, longest_prompt: int) -> int:
    return longest_prompt + cfg.rollout.max_tokens


@dataclass(frozen=True)
class EngineMemory:
    """A colocated rollout engine's bytes on the shared GPU: while the rank trains, and awake."""
    while_training: int
    awake: int
    sizing: str  # how its share was sized, for messages
    while_training_as: str  # what it holds while the rank trains, for messages


def engine_memory(cfg: RecipeConfig, model: ModelShape, gpu_bytes: int | None) -> EngineMemory:
    """The rollout engine next to a colocated rank, from rollout.engine. vLLM: its share is
    gpu_memory_utilization x the GPU (vllm_options' first, else the engine's, else VLLMEngine's default), or
    with vllm_options.kv_cache_memory_bytes that KV cache + its bf16 weights + ENGINE_RUNTIME_BYTES; asleep it
    keeps ENGINE_ASLEEP_BYTES, and its weights where early_weights_wake maps them back while the rank trains.
    The native engine never sleeps: its weights + kv_cache_tokens of KV + ENGINE_RUNTIME_BYTES (+ its vLLM
    drafter's share with fast_path vllm). A second vLLM engine (stock_for_off) doubles what is sized per
    engine. Tensor parallelism spreads weights and KV over its GPUs."""
    engine = cfg.rollout.engine
    tp = engine.get("tensor_parallel_size", 1) or 1
    weights = BF16 * model.params // tp
    if worker_backend_of(cfg) == "native":
        return _native_engine_memory(engine, model, weights, tp, gpu_bytes)
    vllm_options = engine.get("vllm_options") or {}
    engines = 2 if engine.get("stock_for_off") and not engine.get("stock_only") and cfg.numerics != "stock" else 1
    kv_bytes = vllm_options.get("kv_cache_memory_bytes")
    if kv_bytes:
        awake = engines * (int(kv_bytes) + weights + ENGINE_RUNTIME_BYTES)
        label = f"vLLM, kv_cache_memory_bytes {int(kv_bytes) / GiB:.1f} GiB + weights"
    else:
        share = vllm_options.get("gpu_memory_utilization", engine.get("gpu_memory_utilization"))
        share = _vllm_default_share() if share is None else share
        # vLLM fills its share (its KV cache takes what the rest leaves); what it keeps asleep is counted on
        # top, as its sleep frees a little more than the share (docs/performance.md: 43.5 GiB at 0.3 of an H200)
        awake = (int(share * gpu_bytes) if gpu_bytes else 0) + engines * ENGINE_ASLEEP_BYTES
        label = f"vLLM, gpu_memory_utilization {share:g}"
    if not engine_sleeps(cfg):
        return EngineMemory(awake, awake, label, "awake: rollout.sleep_while_training is false")
    asleep = engines * (ENGINE_ASLEEP_BYTES + (weights if engine.get("early_weights_wake") else 0))
    early = ", its weights mapped back by early_weights_wake" if engine.get("early_weights_wake") else ""
    return EngineMemory(asleep, awake, label, f"asleep{early}")


def engine_sleeps(cfg: RecipeConfig) -> bool:
    """The rollout engines release their memory while the rank trains: recipes.rollouts.engines_sleep, on
    vLLM workers (the native engine has no sleep). Imported where used: recipes.rollouts imports Ray."""
    from .rollouts import engines_sleep
    return engines_sleep(cfg) and worker_backend_of(cfg) == "vllm"


def worker_backend_of(cfg: RecipeConfig) -> str:
    """recipes.rollouts.worker_backend of the run's rollout workers, imported where used (it imports Ray)."""
    from .rollouts import worker_backend
    return worker_backend(cfg.rollout)


def _native_engine_memory(engine: dict, model: ModelShape, weights: int, tp: int, gpu_bytes: int | None):
    from rollout_service.engine.config import EngineConfig
    tokens = engine.get("kv_cache_tokens", EngineConfig.kv_cache_tokens)
    held = weights + tokens * model.kv_bytes_per_token // tp + ENGINE_RUNTIME_BYTES
    label = f"native engine, kv_cache_tokens {tokens}"
    if engine.get("fast_path") == "vllm":
        share = (engine.get("fast_path_options") or {}).get("gpu_memory_utilization", VLLM_PROPOSER_SHARE)
        held += int(share * gpu_bytes) if gpu_bytes else 0
        label += f" and a vLLM drafter at gpu_memory_utilization {share:g}"
    return EngineMemory(held, held, label, "awake: the native engine never sleeps")


def _vllm_default_share() -> float:
    """VLLMEngine's gpu_memory_utilization default (its signature is the one place it is set)."""
    from rollout_service.vllm.engine import VLLMEngine
    return inspect.signature(VLLMEngine).parameters["gpu_memory_utilization"].default


def push_stage_bytes(cfg: RecipeConfig, model: ModelShape) -> int:
    """The bf16 stage of a bucketed push that rank 0 keeps between pushes (weight_sync.SenderStage), when the
    weights fit trainer.weight_stage_mb; 0 for object-store pushes, whose state dict goes to the host."""
    if cfg.trainer.weight_sync == "object_store":
        return 0
    numel = model.state_dict_numel
    return BF16 * numel if stages_whole(numel, cfg.trainer.weight_stage_mb << 20) else 0


def push_bucket_bytes(cfg: RecipeConfig, model: ModelShape) -> int:
    """A streamed push's bucket on rank 0, held while it pushes (not between pushes)."""
    if cfg.trainer.weight_sync == "object_store" or push_stage_bytes(cfg, model):
        return 0
    return cfg.trainer.weight_bucket_mb << 20


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU rank's memory for the run `cfg` of the policy `model` whose longest prompt has
    `longest_prompt` tokens, on `gpu` (None: not known yet; check() then passes). Terms in bytes."""
    cfg: RecipeConfig
    model: ModelShape
    longest_prompt: int
    gpu: GpuMemory | None = None

    def on_gpu(self, gpu: GpuMemory) -> MemoryPlan:
        return dataclasses.replace(self, gpu=gpu)

    # -- the numbers ------------------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return micro_batch_tokens(self.cfg, self.longest_prompt)

    @property
    def colocated(self) -> bool:
        return self.cfg.placement == "colocated"

    @property
    def engine_wakes_after_step(self) -> bool:
        """A rollout engine sleeps on this rank's GPU while the rank trains and wakes for the weight push."""
        return self.colocated and engine_sleeps(self.cfg)

    @property
    def engine(self) -> EngineMemory | None:
        return engine_memory(self.cfg, self.model, self.gpu and self.gpu.total_bytes) if self.colocated else None

    @property
    def sharded_states(self) -> dict[str, int]:
        m, ranks = self.model, self.cfg.trainer.num_ranks
        share = f"1/{ranks} of {m.params / 1e9:.2f}B parameters"
        return {f"master weights (fp32, {share})": MASTER_WEIGHT_BYTES * m.params // ranks,
                f"gradients (fp32, {share})": GRADIENT_BYTES * m.params // ranks,
                f"AdamW states (2 x fp32, {share})": ADAM_STATE_BYTES * m.params // ranks}

    @property
    def activations(self) -> int:
        """What autograd keeps for the largest micro-batch (see SAVED_*, CHECKPOINTED_*)."""
        m, tokens = self.model, self.tokens
        after = SAVED_HIDDEN_AFTER_LAYERS * m.hidden * BF16 + ROTARY_BYTES_PER_HEAD_DIM * m.head_dim
        if self.cfg.trainer.activation_checkpointing:
            per_token = (CHECKPOINTED_HIDDEN_PER_LAYER * m.hidden * BF16 * m.layers
                         + m.largest_layer_saved_bytes_per_token + after)
        else:
            per_token = m.all_layers_saved_bytes_per_token + after
        return tokens * per_token

    def training_terms(self) -> dict[str, int]:
        """The backward of the largest micro-batch, every term by name."""
        m, tokens = self.model, self.tokens
        checkpointed = ", checkpointed" if self.cfg.trainer.activation_checkpointing else ""
        terms = dict(self.sharded_states)
        terms.update({
            f"gathered bf16 weights ({GATHERED_LAYERS} layers + embedding and head)":
                BF16 * (GATHERED_LAYERS * m.largest_layer_params + m.root_params),
            f"unsharded gradients ({GATHERED_LAYERS} layers, bf16 + fp32)":
                UNSHARDED_GRADIENT_BYTES * GATHERED_LAYERS * m.largest_layer_params,
            f"activations ({tokens} tokens{checkpointed})": self.activations,
            "backward working set (one layer's gradients)":
                BACKWARD_WORKSPACE_LAYERS * tokens * m.largest_layer_saved_bytes_per_token,
            f"lm head logits (a chunk of {min(tokens, HEAD_CHUNK_ROWS)} rows, fp32)":
                LOGITS_CHUNK_BYTES * min(tokens, HEAD_CHUNK_ROWS) * m.vocab,
            "lm head weight gradient": HEAD_GRADIENT_BYTES * m.vocab * m.hidden,
            "weight push stage (bf16, rank 0, kept between pushes)": push_stage_bytes(self.cfg, m),
        })
        engine = self.engine
        if engine is not None:
            terms[f"rollout engine while the rank trains ({engine.while_training_as}; {engine.sizing})"] = (
                engine.while_training)
        return _with_runtime(terms)

    def wake_terms(self) -> dict[str, int]:
        """The engine's wake after the last backward (colocated, engines asleep while training); {} otherwise."""
        if not self.engine_wakes_after_step:
            return {}
        m, ranks = self.model, self.cfg.trainer.num_ranks
        terms = dict(self.sharded_states)
        terms.update({
            "AdamW step temporaries (fp32)": OPTIMIZER_STEP_BYTES * m.params // ranks,
            "weight push stage or bucket (bf16, rank 0)":
                push_stage_bytes(self.cfg, m) + push_bucket_bytes(self.cfg, m),
            f"rollout engine awake ({self.engine.sizing})": self.engine.awake,
        })
        return _with_runtime(terms)

    @property
    def total(self) -> int:
        return max(sum(self.training_terms().values()), sum(self.wake_terms().values()))

    @property
    def fits(self) -> bool:
        return self.gpu is None or self.total <= self.gpu.total_bytes

    # -- the verdict ------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise MemoryPlanRefused when the plan does not fit its GPU (nothing when the GPU is not known)."""
        if not self.fits:
            raise MemoryPlanRefused(self.refusal())

    def report(self) -> str:
        """Every term and the totals, in GiB, and the GPU's memory."""
        gpu = (f"{_gib(self.gpu.total_bytes)} GiB ({self.gpu.name})" if self.gpu is not None else "not known")
        lines = [f"memory plan of a trainer rank's GPU (rank 0): about {_gib(self.total)} GiB; the GPU has {gpu}",
                 f"  training, at the backward of the largest micro-batch ({self.tokens} tokens):"]
        lines += _term_lines(self.training_terms())
        wake = self.wake_terms()
        if wake:
            lines.append("  the rollout engine's wake for the weight push, after the last backward:")
            lines += _term_lines(wake)
        return "\n".join(lines)

    def refusal(self) -> str:
        return "\n".join([f"the run does not fit a trainer rank's GPU: it needs about {_gib(self.total)} GiB of "
                          f"{_gib(self.gpu.total_bytes)} GiB", self.report(), "  what would make it fit:",
                          *(f"    {line}" for line in self.fixes())])

    def fixes(self) -> list[str]:
        """The knobs, each with what it would change here."""
        lines = [self._checkpointing_fix(), self._budget_fix(), self._ranks_fix()]
        if self.colocated:
            lines += self._engine_fixes()
        lines.append(self._max_tokens_fix())
        return [line for line in lines if line]

    def _variant(self, **trainer) -> MemoryPlan:
        cfg, rollout = self.cfg, self.cfg.rollout
        if self.colocated and "num_ranks" in trainer:  # a worker next to each rank
            rollout = dataclasses.replace(rollout, num_workers=trainer["num_ranks"])
        return dataclasses.replace(self, cfg=dataclasses.replace(
            cfg, trainer=dataclasses.replace(cfg.trainer, **trainer), rollout=rollout))

    def _verdict(self) -> str:
        return f"total {_gib(self.total)} GiB ({'fits' if self.fits else 'still too much'})"

    def _checkpointing_fix(self) -> str | None:
        if self.cfg.trainer.activation_checkpointing:
            return None
        other = self._variant(activation_checkpointing=True)
        return (f"trainer.activation_checkpointing=true: activations {_gib(self.activations)} -> "
                f"{_gib(other.activations)} GiB; {other._verdict()}")

    def _budget_fix(self) -> str:
        now = self.cfg.trainer.max_tokens_per_micro_batch
        shortest = longest_sequence(self.cfg, self.longest_prompt)
        if not self._variant(max_tokens_per_micro_batch=shortest).fits:
            return (f"trainer.max_tokens_per_micro_batch (now {now}): even one sequence ({shortest} tokens) per "
                    f"micro-batch does not fit with the rest as it is")
        low, high = shortest, max(self.tokens, shortest)  # low fits; find the largest budget that does
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self._variant(max_tokens_per_micro_batch=mid).fits else (low, mid - 1)
        low = max(shortest, low // BUDGET_STEP * BUDGET_STEP)
        return (f"trainer.max_tokens_per_micro_batch={low} (now {now}; {self.tokens} tokens in the largest "
                f"micro-batch): the activations follow the tokens of a micro-batch")

    def _ranks_fix(self) -> str:
        ranks = self.cfg.trainer.num_ranks
        states = _gib(sum(self.sharded_states.values()))
        more = ", and rollout.num_workers with it" if self.colocated else ""
        for r in range(ranks + 1, MAX_RANKS_ADVISED + 1):
            if self._variant(num_ranks=r).fits:
                return (f"trainer.num_ranks={r} (now {ranks}; a GPU each{more}): weights, gradients and AdamW "
                        f"states, {states} GiB here, are sharded over the ranks")
        return (f"trainer.num_ranks (now {ranks}): up to {MAX_RANKS_ADVISED} ranks alone do not make it fit; "
                f"their sharded states are {states} GiB here")

    def _engine_fixes(self) -> list[str]:
        engine = self.engine
        lines = [f"rollout.engine.gpu_memory_utilization or rollout.engine.vllm_options.kv_cache_memory_bytes "
                 f"(rollout.engine.kv_cache_tokens for the native engine): the engine's share is "
                 f"{_gib(engine.awake)} GiB awake"]
        if not engine_sleeps(self.cfg) and worker_backend_of(self.cfg) == "vllm":
            asleep = dataclasses.replace(self.cfg, rollout=dataclasses.replace(self.cfg.rollout,
                                                                               sleep_while_training=True))
            other = dataclasses.replace(self, cfg=asleep)
            lines.append(f"rollout.sleep_while_training=true: the engine keeps {_gib(other.engine.while_training)} "
                         f"GiB while the rank trains instead of {_gib(engine.while_training)}; {other._verdict()}")
        return lines

    def _max_tokens_fix(self) -> str:
        longest = longest_sequence(self.cfg, self.longest_prompt)
        role = ("the smallest token budget" if self.cfg.trainer.max_tokens_per_micro_batch > 0
                else "and with it every micro-batch's tokens")
        return (f"rollout.max_tokens (now {self.cfg.rollout.max_tokens}): with the longest prompt "
                f"({self.longest_prompt} tokens) it sets the longest sequence, {longest} tokens, {role}")


def plan_memory(cfg: RecipeConfig, model_config, longest_prompt: int, gpu: GpuMemory | None = None) -> MemoryPlan:
    """The memory plan of the run `cfg` for the policy whose Hugging Face config is `model_config`."""
    return MemoryPlan(cfg, ModelShape.of(model_config), int(longest_prompt), gpu)


def out_of_memory_message(error: BaseException, plan: MemoryPlan | None, applied: int, steps: int) -> str:
    """TrainerOutOfMemory's message: what ran out, what of the step was applied, the plan, the knobs."""
    what = str(error).strip().splitlines()[0][:400] if str(error).strip() else type(error).__name__
    done = ("none of its optimizer steps was applied" if applied == 0
            else f"{applied} of its {steps} optimizer steps were applied")
    lines = [f"the train step ran out of GPU memory ({what}); {done}. The rank dropped the step's gradients "
             f"and cached memory and can step again.",
             plan.report() if plan is not None else "This rank has no memory plan.",
             f"What makes a step smaller: {KNOBS}."]
    return "\n".join(lines)


def _with_runtime(terms: dict[str, int]) -> dict[str, int]:
    others = sum(terms.values())
    terms[f"CUDA runtime and allocator slack ({ALLOCATOR_SLACK:.0%} of the rest)"] = (
        RUNTIME_BYTES + int(ALLOCATOR_SLACK * others))
    return terms


def _term_lines(terms: dict[str, int]) -> list[str]:
    lines = [f"    {_gib(v):>8} GiB  {name}" for name, v in terms.items()]
    lines.append(f"    {_gib(sum(terms.values())):>8} GiB  total")
    return lines


def _gib(n: int | float) -> str:
    return f"{n / GiB:.1f}"
