"""Patch a Hugging Face causal LM in place so that its forward is the canonical forward."""
from __future__ import annotations

import types

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from kernels.forward import (SUPPORTED_ARCHITECTURES, CANONICAL_OPS, compute_logits, decoder_layer_forward,
                             forward_hidden, model_spec)


def _layer_forward(self, hidden_states, ctx):
    return decoder_layer_forward(self, hidden_states, ctx)


class RoutingSink:
    """Where a forward puts its MoE routing: `layers` receives each MoE layer's expert ids [B, T, k].

    A plain class on purpose (like kernels.forward.ForwardContext): FSDP2's root pre-forward rebuilds
    the lists, dicts and dataclasses among a call's arguments (casting and moving their tensors), so a
    list passed as an argument would not be the list the layers append to."""
    __slots__ = ("layers",)

    def __init__(self, layers: list):
        self.layers = layers


def _lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, *,
                zerokl_routing: RoutingSink | None = None, **kwargs):
    """Canonical replacement for `LlamaForCausalLM.forward` (and Qwen2/Qwen3/Qwen3-MoE): float32 logits.

    Sequences are right-padded; `attention_mask` is accepted for API compatibility (padding never
    changes the values at real positions, because every row only sees its own earlier tokens).
    zerokl_routing: a RoutingSink whose list receives each MoE layer's expert ids [B, T, k].
    """
    unsupported = {k for k, v in kwargs.items() if v is not None and k not in ("use_cache", "return_dict")}
    if unsupported or labels is not None:
        raise TypeError(f"the canonical forward does not support {sorted(unsupported | ({'labels'} if labels is not None else set()))}")
    ids = check_input_ids(self, input_ids)
    if position_ids is None:
        position_ids = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    if zerokl_routing is not None and not isinstance(zerokl_routing, RoutingSink):
        raise TypeError(f"zerokl_routing must be a RoutingSink, got {type(zerokl_routing).__name__}")
    routing = None if zerokl_routing is None else zerokl_routing.layers
    hidden = forward_hidden(self, ids, position_ids, ops=CANONICAL_OPS, routing=routing)
    return CausalLMOutputWithPast(logits=compute_logits(self, hidden))


def check_input_ids(model: torch.nn.Module, input_ids) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    vocab = model.config.vocab_size
    if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
        raise ValueError(f"input_ids contain ids outside [0, {vocab})")
    weight = model.model.embed_tokens.weight
    if input_ids.device != weight.device and weight.device.type != "meta":
        raise ValueError(f"input_ids are on {input_ids.device} but the model is on {weight.device}")
    return input_ids.long()


def patch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Make `model` (Llama / Qwen2 / Qwen3 dense causal LM) run the canonical forward; idempotent.

    Each decoder layer's forward and the model's forward are replaced on the instance, so FSDP2's
    `fully_shard` (applied before or after) still unshards parameters around each layer.
    """
    model_spec(model)  # raises TypeError / ValueError for anything unsupported
    if model.__dict__.get("_zerokl_patched"):
        return model
    for layer in model.model.layers:
        layer.forward = types.MethodType(_layer_forward, layer)
        layer.__dict__["_zerokl_patched"] = True
    model.forward = types.MethodType(_lm_forward, model)
    model.__dict__["_zerokl_patched"] = True
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return bool(model.__dict__.get("_zerokl_patched"))
