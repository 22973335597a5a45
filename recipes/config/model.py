"""The policy's sections of the recipe config: `model` (its starting weights), `canonical` (its forward's
segment tree) and `warmup` (supervised steps before GRPO)."""
from __future__ import annotations

from dataclasses import dataclass, field

BYTE_TOKENIZER = "bytes"  # model.tokenizer: the byte-level tokenizer built in, not a hub id or directory
ALL_LINEAR = "all-linear"  # model.lora.target_modules: every projection of the decoder (PEFT's name)


@dataclass(frozen=True)
class LoraSection:
    """The `model.lora` section: the trainer trains a LoRA adapter (PEFT's LoraConfig with these r,
    lora_alpha and target_modules, lora_dropout 0) on the base, which stays frozen in bf16; only the
    adapter has optimizer state. The rollout workers serve it under `name`, every request names it, and
    each push sends the adapter alone (RolloutClient.load_adapter). Checkpoints add it as a PEFT adapter."""
    r: int = 16
    """The adapter's rank."""
    alpha: float = 32.0
    """PEFT's lora_alpha: the adapter's output is scaled by alpha / r."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """The projections it adapts (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj), or [all-linear]."""
    name: str = "policy"
    """The adapter's name on the rollout pool (SamplingParams.adapter)."""

    def targets(self) -> list[str]:
        """target_modules with all-linear spelled out."""
        from rollout_service.lora import PROJECTIONS
        if self.target_modules == [ALL_LINEAR]:
            return [name for names in PROJECTIONS.values() for name in names]
        return list(self.target_modules)

    def peft_config(self):
        """PEFT's own LoraConfig of this section."""
        from peft import LoraConfig
        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=self.targets(), lora_dropout=0.0)


@dataclass(frozen=True)
class ModelConfig:
    """The `model` section: the policy's starting weights (and the tokenizer of the gsm8k task)."""
    source: str = "tiny"
    """tiny (a random model made by the project) | hf (a hub id or local checkpoint in `name`)."""
    name: str | None = None
    """hf: the hub id or local checkpoint directory (required); also gsm8k's tokenizer unless `tokenizer`."""
    tokenizer: str | None = None
    """gsm8k: the tokenizer's hub id or local directory, when it is not `name`'s; null: `name`; `bytes`: the
    project's byte-level tokenizer (rollout_service.tiny_models.byte_level_tokenizer, no download), for a
    tiny model on real text."""
    # tiny: rollout_service.tiny_models options; null keeps that module's default
    arch: str | None = None
    """tiny: the architecture, llama | qwen2 | qwen3 | qwen3_moe."""
    hidden_size: int | None = None
    """tiny: the hidden size (model width)."""
    num_layers: int | None = None
    """tiny: the number of decoder layers."""
    num_heads: int | None = None
    """tiny: the number of attention (query) heads."""
    num_kv_heads: int | None = None
    """tiny: the number of key/value heads (fewer than num_heads: grouped-query attention)."""
    intermediate_size: int | None = None
    """tiny: the MLP's intermediate width (qwen3_moe: each expert's is half of it)."""
    max_positions: int | None = None
    """tiny: max_position_embeddings, the engines' default max_model_len."""
    head_dim: int | None = None
    """tiny, qwen3 and qwen3_moe: the attention head width; null: hidden_size / num_heads (Qwen3-4B: 128)."""
    tie_word_embeddings: bool | None = None
    """tiny: the lm head shares the embedding's weight (Qwen3-4B and smaller Qwen models do)."""
    vocab_size: int | None = None
    """tiny: logits width, >= the tokenizer's; null: the tokenizer's; more: a real model's (benchmarks)."""
    lora: LoraSection | None = None
    """The `model.lora` section: train a LoRA adapter on the frozen base; null: train the whole model."""

    def tiny_options(self) -> dict:
        """The tiny model's keyword options that are set."""
        names = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "max_positions", "head_dim", "tie_word_embeddings")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


@dataclass(frozen=True)
class CanonicalTreeConfig:
    """The `canonical` section: the canonical forward's row-parallel segment tree."""
    tree_segments: int | None = None
    """Tree width, 1, 2, 4 or 8: the largest TP degree that reproduces the trainer; null: ZEROKL_TREE_SEGMENTS
    or 8. Given to every rollout worker and trainer rank; the run's config.yaml records the width used."""


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised steps on the task's answers before GRPO (0 = none); skipped when resuming."""
    steps: int = 0
    """AdamW steps of the warm-up; 0: no warm-up."""
    lr: float = 3e-3
    """The warm-up's AdamW learning rate (no weight decay)."""
    batch_size: int = 64
    """(prompt, answer) examples per step, drawn at random with replacement from the whole task (seeded)."""
    device: str = "cpu"
    """cpu | cuda (the driver's GPU, before the workers and ranks start)."""

