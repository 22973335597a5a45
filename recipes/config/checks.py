"""The recipe config's checks beyond the types: every numeric field's range, the allowed values, and how
settings fit together. Rule: a value the run cannot use is refused at load, naming its key, not steps later
inside a Ray actor."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kernels import TREE_WIDTHS
from rollout_service.service.switch_modes import SWITCH_MODES
from rollout_service.tiny_models import ARCHITECTURES

from .choices import (
    LENGTH_DISTRIBUTIONS,
    MODEL_SOURCES,
    NUMERICS,
    OLD_LOGPROBS,
    PLACEMENT_STRATEGIES,
    PLACEMENTS,
    ROLLOUT_CORRECTIONS,
    TASK_KINDS,
    TRAINER_DEVICES,
    WEIGHT_TRANSPORTS,
)
from .errors import ConfigError

if TYPE_CHECKING:
    from .recipe import RecipeConfig

# The range of every numeric field: (test, the range in words). Rule: a value the run cannot use is refused
# at load, naming its key, not steps later inside a Ray actor. The tests are comparisons that NaN fails;
# a null (optional) value is not checked; a key ending in [] is each element of a list.
POSITIVE = (lambda v: v > 0, "> 0")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
NUMERIC_RANGES = {
    "seed": NON_NEGATIVE,
    "task.max_operand": NON_NEGATIVE,
    "task.max_turns": POSITIVE,
    "task.max_prompt_tokens": NON_NEGATIVE,
    "task.stop_token_ids[]": NON_NEGATIVE,
    **{f"model.{k}": AT_LEAST_1 for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                          "intermediate_size", "max_positions", "head_dim", "vocab_size")},
    "model.lora.r": AT_LEAST_1,
    "model.lora.alpha": POSITIVE,
    "warmup.steps": NON_NEGATIVE,
    "warmup.lr": POSITIVE,
    "warmup.batch_size": AT_LEAST_1,
    "rollout.num_workers": AT_LEAST_1,
    "rollout.start_timeout_s": POSITIVE,
    "rollout.n": (lambda v: v >= 2, ">= 2: group-normalised advantages need several samples per prompt"),
    "rollout.max_tokens": AT_LEAST_1,
    "rollout.length_median": AT_LEAST_1,
    "rollout.length_sigma": NON_NEGATIVE,
    "rollout.temperature": NON_NEGATIVE,
    "rollout.top_k": (lambda v: v >= -1, ">= -1 (-1 or 0: off)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "in (0, 1] (1: off)"),
    "trainer.num_ranks": AT_LEAST_1,
    "trainer.placement.torch_threads": NON_NEGATIVE,
    "trainer.optimizer.lr": POSITIVE,
    "trainer.optimizer.betas[]": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "trainer.optimizer.weight_decay": NON_NEGATIVE,
    "trainer.optimizer.max_grad_norm": NON_NEGATIVE,
    "trainer.loss.clip_low": NON_NEGATIVE,
    "trainer.loss.clip_high": NON_NEGATIVE,
    "trainer.loss.rollout_correction_cap": (lambda v: v > 1, "> 1"),
    "trainer.batching.mini_batches": AT_LEAST_1,
    "trainer.batching.micro_batch_size": NON_NEGATIVE,
    "trainer.batching.max_tokens_per_micro_batch": NON_NEGATIVE,
    "trainer.batching.checkpoint_every": AT_LEAST_1,
    "trainer.weight_push.bucket_mb": AT_LEAST_1,
    "trainer.weight_push.stage_mb": NON_NEGATIVE,
    "trainer.weight_push.timeout_s": POSITIVE,
    "train.steps": AT_LEAST_1,
    "train.prompts_per_step": AT_LEAST_1,
    "train.save_every": NON_NEGATIVE,
    "train.async_steps": NON_NEGATIVE,
}


def _values_at(cfg: RecipeConfig, key: str) -> list[tuple[str, object]]:
    """(dotted path, value) of a NUMERIC_RANGES key: the field's value, or each element of a `key[]` list."""
    name = key.removesuffix("[]")
    value = cfg
    for part in name.split("."):
        value = None if value is None else getattr(value, part)  # an optional section that is off
    if value is None:
        return [(name, None)]
    if key.endswith("[]"):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [(name, value)]


def _check_ranges(cfg: RecipeConfig) -> None:
    betas = cfg.trainer.optimizer.betas
    if len(betas) != 2:
        raise ConfigError(f"trainer.optimizer.betas must be [beta1, beta2], got {betas!r}")
    for key, (in_range, allowed) in NUMERIC_RANGES.items():
        for path, value in _values_at(cfg, key):
            if value is None:
                continue
            if isinstance(value, float) and math.isinf(value):
                raise ConfigError(f"{path} must be finite, got {value!r}")
            if not in_range(value):
                raise ConfigError(f"{path} must be {allowed}, got {value!r}")


def _check_lora(cfg: RecipeConfig) -> None:
    from rollout_service.lora import PROJECTIONS

    from .model import ALL_LINEAR
    lora, known = cfg.model.lora, [n for names in PROJECTIONS.values() for n in names]
    bad = [t for t in lora.target_modules if t not in known] if lora.target_modules != [ALL_LINEAR] else []
    if not lora.target_modules or bad:
        raise ConfigError(f"model.lora.target_modules must name projections of {known}, or be [{ALL_LINEAR}]; "
                          f"got {lora.target_modules!r}")
    if not lora.name:
        raise ConfigError("model.lora.name must be a non-empty adapter name")
    if cfg.numerics != "canonical" and cfg.rollout.engine.get("backend", "auto") == "native":
        raise ConfigError("model.lora with numerics: stock is the stock LoRA pipeline, whose rollouts are vLLM's own "
                          "LoRA: set rollout.engine.backend to vllm (or auto on GPUs)")
    if cfg.model.arch == "qwen3_moe":
        raise ConfigError("model.lora adapts dense projections; qwen3_moe's experts are not adapted")


def check_values(cfg: RecipeConfig) -> None:
    """Checks beyond the types: allowed values and how settings fit together."""
    def one_of(path: str, value, allowed) -> None:
        if value not in allowed:
            raise ConfigError(f"{path} must be one of {', '.join(map(str, allowed))}, got {value!r}")

    _check_ranges(cfg)  # first: the checks below divide by and compare these values
    t, m, r, tr, train = cfg.task, cfg.model, cfg.rollout, cfg.trainer, cfg.train
    loss, push = tr.loss, tr.weight_push
    one_of("task.kind", t.kind, TASK_KINDS)
    one_of("model.source", m.source, MODEL_SOURCES)
    if m.source == "hf" and not m.name:
        raise ConfigError("model.name is required when model.source is hf")
    if m.arch is not None:
        one_of("model.arch", m.arch, ARCHITECTURES)
    if m.head_dim is not None and m.arch not in ("qwen3", "qwen3_moe"):
        raise ConfigError(f"model.head_dim is a qwen3 / qwen3_moe option (llama and qwen2 take hidden_size / "
                          f"num_heads); got model.arch {m.arch!r}")
    if m.lora is not None:
        _check_lora(cfg)
    width = cfg.canonical.tree_segments
    if width is not None and (width not in TREE_WIDTHS or isinstance(width, bool)):
        raise ConfigError(f"canonical.tree_segments must be one of {TREE_WIDTHS} or null, got {width!r}")
    one_of("rollout.length_distribution", r.length_distribution, LENGTH_DISTRIBUTIONS)
    if r.length_distribution == "lognormal" and (r.length_median is None
                                                 or not 1 <= r.length_median <= r.max_tokens):
        raise ConfigError(f"rollout.length_median must be in 1 .. rollout.max_tokens ({r.max_tokens}) when "
                          f"rollout.length_distribution is lognormal, got {r.length_median!r}")
    one_of("trainer.device", tr.device, TRAINER_DEVICES)
    one_of("warmup.device", cfg.warmup.device, TRAINER_DEVICES)
    one_of("trainer.loss.old_logprobs", loss.old_logprobs, OLD_LOGPROBS)
    one_of("trainer.loss.rollout_correction", loss.rollout_correction, ROLLOUT_CORRECTIONS)
    if loss.rollout_correction != "none" and loss.old_logprobs != "recompute":
        # the correction's ratio is the trainer's old log-prob over the rollout's: with old_logprobs=rollout
        # they are the same numbers and the ratio is 1
        raise ConfigError(f"trainer.loss.rollout_correction={loss.rollout_correction} needs "
                          "trainer.loss.old_logprobs=recompute")
    one_of("numerics", cfg.numerics, NUMERICS)
    one_of("placement", cfg.placement, PLACEMENTS)
    one_of("trainer.placement.strategy", tr.placement.strategy, PLACEMENT_STRATEGIES)
    if r.placement_strategy is not None:
        one_of("rollout.placement_strategy", r.placement_strategy, PLACEMENT_STRATEGIES)
        if cfg.placement != "split":
            raise ConfigError("rollout.placement_strategy places split workers; placement colocated puts each "
                              "worker on its rank's bundle (trainer.placement.strategy)")
        if r.engine.get("tensor_parallel_size", 1) > 1:
            raise ConfigError("rollout.placement_strategy gives each worker one bundle; workers of "
                              "tensor_parallel_size > 1 reserve a placement group each: set it to null")
    if cfg.numerics == "stock" and loss.old_logprobs != "recompute":
        # stock rollouts' log-probs are not the trainer's: the ratio's denominator must be recomputed
        raise ConfigError("numerics: stock needs trainer.loss.old_logprobs=recompute (stock rollout log-probs "
                          "differ from the trainer's)")
    if cfg.numerics == "stock" and r.determinism.runs_canonical:
        raise ConfigError("numerics: stock runs rollout.determinism=off (the stock engines); got "
                          f"{r.determinism.value!r}")
    if cfg.placement == "colocated" and r.num_workers != tr.num_ranks:
        raise ConfigError(f"placement: colocated puts one rollout worker next to each trainer rank: "
                          f"rollout.num_workers ({r.num_workers}) must equal trainer.num_ranks ({tr.num_ranks})")
    one_of("trainer.weight_push.transport", push.transport, WEIGHT_TRANSPORTS)
    one_of("trainer.weight_push.switch", push.switch, SWITCH_MODES)
    if push.switch != "drain" and push.transport != "object_store":
        raise ConfigError(f"trainer.weight_push.switch={push.switch} needs trainer.weight_push.transport="
                          f"object_store (bucketed pushes switch in drain mode only), got {push.transport!r}")
    if train.async_steps and (cfg.placement != "split" or cfg.numerics != "canonical"
                              or loss.old_logprobs != "rollout"):
        # colocated engines sleep while the trainer steps; the stock arm's and a recomputed denominator
        # are not the behaviour policy's log-probs
        raise ConfigError("train.async_steps > 0 needs placement split, numerics canonical and "
                          "trainer.loss.old_logprobs rollout")
    if train.prompts_per_step % tr.batching.mini_batches:
        raise ConfigError("train.prompts_per_step must be divisible by trainer.batching.mini_batches")
