"""The policy's starting weights: a tiny project-made model, or a Hugging Face checkpoint."""
from __future__ import annotations

import torch

from rollout_service.tiny_models import tiny_config, tiny_model

from .config import RecipeConfig


def policy_config(cfg: RecipeConfig, tokenizer):
    """The Hugging Face config of the model initial_model builds, read without building it (no weights)."""
    spec = cfg.model
    if spec.source == "tiny":
        return tiny_config(vocab_size=spec.vocab_size or len(tokenizer), **spec.tiny_options())
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(spec.name)


def initial_model(cfg: RecipeConfig, tokenizer) -> torch.nn.Module:
    """A bf16 causal LM in eval mode whose vocabulary covers the tokenizer.

    cfg.model: source tiny (rollout_service.tiny_models options: arch, hidden_size, ...) or source hf
    (name: a hub id or local dir).
    """
    spec = cfg.model
    if spec.source == "tiny":
        model = tiny_model(seed=cfg.seed, vocab_size=spec.vocab_size or len(tokenizer), **spec.tiny_options())
    elif spec.source == "hf":
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(spec.name, dtype=torch.bfloat16)
    else:
        raise ValueError(f"unknown model source {spec.source!r}")  # a new source also goes into config.MODEL_SOURCES
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(f"model vocab {model.config.vocab_size} < tokenizer vocab {len(tokenizer)}")
    return model.to(torch.bfloat16).eval()
