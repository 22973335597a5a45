"""The trainer's LoRA adapter: PEFT's layers put into the (patched) model, and the adapter's tensors out
of it by PEFT's names, for pushes and checkpoints.

The canonical forward runs PEFT's LoRA layers itself (kernels/lora.py), so the adapter the ranks train is
the one the rollout workers serve, bit for bit.
"""
from __future__ import annotations

import re

import torch

from rollout_service.lora import LoraAdapter, save_adapter

# a trainer state-dict name of an adapter tensor: PEFT's, with the adapter's name ("default") inside
_TRAINER_KEY = re.compile(r"^(.*\.lora_[AB])\.default\.weight$")


def add_lora(model: torch.nn.Module, peft_config, seed: int) -> torch.nn.Module:
    """PEFT's LoRA layers (adapter "default") into `model` in place, before fully_shard: the base's
    parameters frozen in bf16 (what the forward reads: the same bits, half the memory), the adapter's
    trainable in float32 (its master weights). Rule: PEFT
    draws lora_A from torch's global generator, so it draws here from one seeded by `seed` (the run's):
    every rank makes the same whole adapter before fully_shard keeps its shard, and a run made again
    starts from the same adapter."""
    from peft import inject_adapter_in_model
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config, model)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.data = p.data.float()
        elif p.requires_grad:
            raise RuntimeError(f"{name} is trainable beside the LoRA adapter")
    return model


def adapter_key(name: str) -> str | None:
    """PEFT's saved name of a trainer state-dict entry of the adapter (model.layers.0.self_attn.q_proj.
    lora_A.weight), or None for the base's entries."""
    m = _TRAINER_KEY.match(name)
    return None if m is None else f"{m.group(1)}.weight"


def adapter_settings(section) -> dict:
    """A model.lora section's adapter settings as the pool takes them (rollout_service.lora.LoraAdapter.settings)."""
    peft = section.peft_config()
    return {"r": peft.r, "alpha": float(peft.lora_alpha), "target_modules": tuple(sorted(peft.target_modules)),
            "use_rslora": False}


def adapter_push(section) -> tuple | None:
    """RankWeightPush's adapter: (its name on the pool, its settings, no expected digest); None without LoRA."""
    return None if section is None else (section.name, adapter_settings(section), None)


def save_trained_adapter(section, state: dict, path: str) -> None:
    """The adapter (adapter_state of the trainer's weights) as a PEFT checkpoint directory at `path`."""
    save_adapter(LoraAdapter.from_settings(adapter_settings(section), state), path)


def adapter_state(state_dict: dict) -> dict:
    """The adapter's entries of a trainer's full state dict, by PEFT's names, in bf16 (what a push carries)."""
    return {adapter_key(k): v.to(torch.bfloat16) for k, v in state_dict.items() if adapter_key(k) is not None}
