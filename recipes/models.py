"""The policy's starting weights: a tiny project-made model, or a Hugging Face checkpoint."""
from __future__ import annotations

import torch


def initial_model(cfg: dict, tokenizer) -> torch.nn.Module:
    """A bf16 causal LM in eval mode whose vocabulary covers the tokenizer.

    cfg["model"]: {source: tiny, arch, hidden_size, ...} (rollout_service.tiny_models keyword options) or
    {source: hf, name: <hub id or local dir>}.
    """
    spec = dict(cfg["model"])
    source = spec.pop("source", "tiny")
    if source == "tiny":
        from rollout_service.tiny_models import tiny_model
        arch = spec.pop("arch", "qwen2")
        model = tiny_model(arch, seed=cfg["seed"], vocab_size=len(tokenizer), **spec)
    elif source == "hf":
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(spec["name"], dtype=torch.bfloat16)
    else:
        raise ValueError(f"unknown model source {source!r}: use tiny or hf")
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(f"model vocab {model.config.vocab_size} < tokenizer vocab {len(tokenizer)}")
    return model.to(torch.bfloat16).eval()
