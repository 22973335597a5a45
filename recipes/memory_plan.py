"""Memory is planned, not discovered: an estimate of one GPU trainer rank's memory in a GRPO run, checked
against the rank's GPU before anything long starts, and named again when a step still runs out of it.

    plan = plan_memory(cfg, model.config, longest_prompt=128, gpu=GpuMemory(141 * GiB, "a stated GPU"))
    plan.check()          # MemoryPlanRefused (a ConfigError): every term, the total, the GPU, the knobs
    print(plan.report())

The estimate is for rank 0, the largest (it also holds the weight push's stage), at two moments of a step:

- training, at the backward of the largest micro-batch: fp32 master weights, fp32 gradients and AdamW's
  two fp32 states, all sharded over trainer.num_ranks by FSDP2; the bf16 weights FSDP2 has gathered; a
  layer's unsharded gradients on their way to the reduce-scatter; the activations autograd keeps (every
  layer's, or with trainer.batching.activation_checkpointing each checkpointed layer's input, the other
  layers' and one layer's recompute); the backward's working set; one chunk of the lm head's logits; the lm head weight's gradient; the weight push's stage;
  on a GPU shared with a rollout engine (placement colocated), what the engine holds meanwhile; the CUDA
  runtime and allocator slack.
- the engine's wake (colocated, the engine asleep while the rank trains): after the last backward the
  rank's sharded states, the optimizer step's temporaries and the stage, next to the engine's whole share.

It is meant to err on the large side, not to be exact. Left out: fragmentation beyond ALLOCATOR_SLACK,
the padding of padded rows (trainer.batching.packing false) beyond the token budget, other processes on the
GPU. The terms' sizes live in recipes.memory_terms, recipes.model_shape and recipes.engine_memory; the knobs
that would make a refused run fit in recipes.memory_fixes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.logprobs import HEAD_CHUNK_ROWS

from .config import ConfigError, RecipeConfig, TrainerConfig
from .engine_memory import EngineMemory, engine_memory, engine_sleeps
from .memory_fixes import KNOBS, fixes
from .memory_terms import (
    ADAM_STATE_BYTES,
    ALLOCATOR_SLACK,
    BACKWARD_WORKSPACE_LAYERS,
    CHECKPOINTED_HIDDEN_PER_LAYER,
    GATHERED_LAYERS,
    GRADIENT_BYTES,
    HEAD_GRADIENT_BYTES,
    LOGITS_CHUNK_BYTES,
    MASTER_WEIGHT_BYTES,
    OPTIMIZER_STEP_BYTES,
    RUNTIME_BYTES,
    UNSHARDED_GRADIENT_BYTES,
    gib,
    micro_batch_tokens,
    push_bucket_bytes,
    push_stage_bytes,
)
from .model_shape import (
    BF16,
    ROTARY_BYTES_PER_HEAD_DIM,
    SAVED_HIDDEN_AFTER_LAYERS,
    ModelShape,
)


class MemoryPlanRefused(ConfigError):
    """The run cannot fit the GPU by its memory plan; the message has every term, the total, the GPU's
    memory and the knobs that would make it fit."""


class TrainerOutOfMemory(RuntimeError):
    """A train step ran out of GPU memory. The rank dropped what the step held (its gradients, FSDP2's
    iteration state, the allocator's cache) and can step again; the message names the plan's numbers, where
    the rank had a plan, and the knobs."""


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

    from rollout_service.ray_placement import on_bundle

    options = {"num_cpus": 0, "num_gpus": trainer.placement.resources_per_rank.get("num_gpus", 1)}
    if placement_group is not None:
        options["scheduling_strategy"] = on_bundle(placement_group, bundle)
    ref = ray.remote(max_calls=1)(device_memory).options(**options).remote()  # .options() refuses max_calls
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        ray.cancel(ref, force=True)
        return None

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
    def trained_params(self) -> int:
        """Parameters with gradients and optimizer state: the whole model's, or a LoRA adapter's."""
        lora = self.cfg.model.lora
        return self.model.params if lora is None else self.model.lora_params(lora.r, lora.targets())

    @property
    def sharded_states(self) -> dict[str, int]:
        m, ranks, trained = self.model, self.cfg.trainer.num_ranks, self.trained_params
        share = f"1/{ranks} of {trained / 1e9:.3f}B parameters"
        terms = {} if self.cfg.model.lora is None else {  # the frozen base: bf16, no gradient, no state
            f"frozen base weights (bf16, 1/{ranks} of {m.params / 1e9:.2f}B)": BF16 * m.params // ranks}
        return {**terms, f"master weights (fp32, {share})": MASTER_WEIGHT_BYTES * trained // ranks,
                f"gradients (fp32, {share})": GRADIENT_BYTES * trained // ranks,
                f"AdamW states (2 x fp32, {share})": ADAM_STATE_BYTES * trained // ranks}

    @property
    def activations(self) -> int:
        """What autograd keeps for the largest micro-batch (see SAVED_*, CHECKPOINTED_*)."""
        m, tokens = self.model, self.tokens
        after = SAVED_HIDDEN_AFTER_LAYERS * m.hidden * BF16 + ROTARY_BYTES_PER_HEAD_DIM * m.head_dim
        batching = self.cfg.trainer.batching
        if batching.activation_checkpointing:  # layers 0, N, 2N, ... checkpointed; the others keep theirs
            checkpointed = -(-m.layers // batching.checkpoint_every)
            kept = m.all_layers_saved_bytes_per_token * (m.layers - checkpointed) // m.layers
            per_token = (CHECKPOINTED_HIDDEN_PER_LAYER * m.hidden * BF16 * checkpointed + kept
                         + m.largest_layer_saved_bytes_per_token + after)
        else:
            per_token = m.all_layers_saved_bytes_per_token + after
        return tokens * per_token

    def training_terms(self) -> dict[str, int]:
        """The backward of the largest micro-batch, every term by name."""
        m, tokens = self.model, self.tokens
        batching = self.cfg.trainer.batching
        checkpointed = (f", checkpointed every {batching.checkpoint_every} layer(s)"
                        if batching.activation_checkpointing else "")
        terms = dict(self.sharded_states)
        terms.update({
            f"gathered bf16 weights ({GATHERED_LAYERS} layers + embedding and head)":
                BF16 * (GATHERED_LAYERS * m.largest_layer_params + m.root_params),
            f"unsharded gradients ({GATHERED_LAYERS} layers, bf16 + fp32)":
                UNSHARDED_GRADIENT_BYTES * GATHERED_LAYERS * min(m.largest_layer_params,
                                                                 self.trained_params // m.layers + 1),
            f"activations ({tokens} tokens{checkpointed})": self.activations,
            "backward working set (one layer's gradients)":
                BACKWARD_WORKSPACE_LAYERS * tokens * m.largest_layer_saved_bytes_per_token,
            f"lm head logits (a chunk of {min(tokens, HEAD_CHUNK_ROWS)} rows, fp32)":
                LOGITS_CHUNK_BYTES * min(tokens, HEAD_CHUNK_ROWS) * m.vocab,
            "lm head weight gradient": HEAD_GRADIENT_BYTES * m.vocab * m.hidden if self.cfg.model.lora is None else 0,
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
            "AdamW step temporaries (fp32)": OPTIMIZER_STEP_BYTES * self.trained_params // ranks,
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
        gpu = (f"{gib(self.gpu.total_bytes)} GiB ({self.gpu.name})" if self.gpu is not None else "not known")
        lines = [f"memory plan of a trainer rank's GPU (rank 0): about {gib(self.total)} GiB; the GPU has {gpu}",
                 f"  training, at the backward of the largest micro-batch ({self.tokens} tokens):"]
        lines += _term_lines(self.training_terms())
        wake = self.wake_terms()
        if wake:
            lines.append("  the rollout engine's wake for the weight push, after the last backward:")
            lines += _term_lines(wake)
        return "\n".join(lines)

    def refusal(self) -> str:
        return "\n".join([f"the run does not fit a trainer rank's GPU: it needs about {gib(self.total)} GiB of "
                          f"{gib(self.gpu.total_bytes)} GiB", self.report(), "  what would make it fit:",
                          *(f"    {line}" for line in self.fixes())])

    def fixes(self) -> list[str]:
        """The knobs, each with what it would change here (recipes.memory_fixes)."""
        return fixes(self)


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
    lines = [f"    {gib(v):>8} GiB  {name}" for name, v in terms.items()]
    lines.append(f"    {gib(sum(terms.values())):>8} GiB  total")
    return lines
