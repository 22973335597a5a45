"""Tiny LoRA fixtures for the LoRA tests: a base checkpoint on disk and adapters trained on it with PEFT
through the canonical forward, as the trainer trains them."""
from __future__ import annotations

import struct

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(checkpoint, patched: bool = True):
    """The base checkpoint loaded the standard way (bf16), patched to the canonical forward or not."""
    from transformers import AutoModelForCausalLM

    import trainer_patch
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    return trainer_patch.patch_model(model) if patched else model


def trained_adapter_model(checkpoint, r: int, targets, steps: int = 3, seed: int = 0):
    """A patched base with a PEFT LoRA adapter (lora_alpha = 2r, no dropout) after `steps` AdamW steps on
    random sequences: B is no longer zero, so the adapter changes every log-prob it touches."""
    from peft import LoraConfig, inject_adapter_in_model

    import trainer_patch
    model = base_model(checkpoint)
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0), model)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=gen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    for _ in range(steps):
        loss = -trainer_patch.token_logprobs(model, ids).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def random_adapter(model, r: int, targets, seed: int):
    """A rollout_service.lora.LoraAdapter of random A and B (B nonzero, alpha 2r) for `model`'s projections
    named in `targets`."""
    from rollout_service.lora import LoraAdapter, projection_shapes
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for (layer, name), (out, inp) in projection_shapes(model).items():
        if name in targets:
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, inp, generator=gen) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=gen) * 0.2
    return LoraAdapter(r=r, alpha=2 * r, target_modules=sorted(targets), use_rslora=False, tensors=tensors)


def rollout_scores(model, rollouts, temperature: float = 1.0) -> list[tuple]:
    """Per rollout, the exact bits of `model`'s canonical log-probs of its generated tokens."""
    import trainer_patch
    out = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_token_ids + r.token_ids])
            lp = trainer_patch.token_logprobs(model, ids, temperature=temperature)[0, len(r.prompt_token_ids) - 1:]
            out.append(tuple(struct.pack("<d", float(x)) for x in lp))
    return out


def logprob_bits(rollouts) -> list[tuple]:
    return [tuple(struct.pack("<d", x) for x in r.logprobs) for r in rollouts]
