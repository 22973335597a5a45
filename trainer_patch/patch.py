"""Patch a Hugging Face causal LM in place so that its forward is the canonical forward."""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

import kernels as K
from kernels.forward import (SUPPORTED_ARCHITECTURES, CANONICAL_OPS, decoder_layer_forward,
                             forward_hidden, lm_head_weight, model_spec)
from kernels.packed_attention import packed_lengths

_CHECKPOINT = "_zerokl_checkpoint"  # layer.__dict__ flag set by checkpoint_activations


def _layer_forward(self, hidden_states, ctx):
    if self.__dict__.get(_CHECKPOINT) and torch.is_grad_enabled():
        return _checkpointed_layer_forward(self, hidden_states, ctx)
    return decoder_layer_forward(self, hidden_states, ctx)


def _checkpointed_layer_forward(layer, hidden_states, ctx):
    """The layer's forward under torch.utils.checkpoint: its activations are dropped after the forward and
    recomputed in its backward. The recompute is the same canonical forward on the same inputs, so it gives
    the same bits; MoE routing is recorded by the first run only (the recompute would append it again)."""
    runs = 0

    def run(hidden):
        nonlocal runs
        runs += 1
        routing = ctx.routing
        if runs > 1:
            ctx.routing = None
        try:
            return decoder_layer_forward(layer, hidden, ctx)
        finally:
            ctx.routing = routing

    return torch.utils.checkpoint.checkpoint(run, hidden_states, use_reentrant=False, preserve_rng_state=False)


def checkpoint_activations(model: torch.nn.Module, every: int = 1) -> torch.nn.Module:
    """Activation checkpointing of decoder layers 0, every, 2 * every, ... (every = 1: all of them; torchtitan's
    selective layer checkpointing otherwise), for a patched model or a stock one (Hugging Face's own
    gradient_checkpointing_enable, non-reentrant). Call before or after fully_shard. Forward values do not
    change, so log-probs keep their bits; gradients are those of the same forward. A layer left out keeps its
    activations, so it is not run again in the backward: fewer checkpointed layers, less recompute, more memory."""
    if every < 1:
        raise ValueError(f"checkpoint every {every}th layer: at least 1")
    layers = model.model.layers
    if is_patched(model):
        for i, layer in enumerate(layers):
            layer.__dict__[_CHECKPOINT] = i % every == 0
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, layer in enumerate(layers):  # transformers' GradientCheckpointingLayer reads this flag per call
            layer.gradient_checkpointing = i % every == 0
    return model


class RoutingSink:
    """Where a forward puts its MoE routing: `layers` receives each MoE layer's expert ids [B, T, k].

    A plain class on purpose (like kernels.forward.ForwardContext): FSDP2's root pre-forward rebuilds
    the lists, dicts and dataclasses among a call's arguments (casting and moving their tensors), so a
    list passed as an argument would not be the list the layers append to."""
    __slots__ = ("layers",)

    def __init__(self, layers: list):
        self.layers = layers


class ScoreTokens:
    """Asks the patched forward for next-token log-probs instead of logits: `positions` [B, T-1] bool marks
    the positions t whose token t + 1 is scored, at `temperature` (the rollout's; 0 = greedy); `entropy` also
    asks for each scored position's entropy (no gradient). Only those positions pass through the lm head, a
    chunk at a time (kernels.head_token_logprobs); the log-probs have the bits of the logits path.
    `vocab_limit`: ids >= it are forbidden, their logits -inf before the log-softmax (kernels.mask_vocab_tail),
    for a rollout that masks them so (a vocabulary padded past its tokenizer's); None: the full vocabulary.

    A plain class for the reason RoutingSink gives."""
    __slots__ = ("positions", "temperature", "entropy", "vocab_limit")

    def __init__(self, positions: torch.Tensor, temperature: float, entropy: bool = False,
                 vocab_limit: int | None = None):
        self.positions, self.temperature, self.entropy = positions, temperature, entropy
        self.vocab_limit = vocab_limit


@dataclass
class TokenScoresOutput(ModelOutput):
    """The patched forward's output under ScoreTokens: [B, T-1] float32, 0 at positions not scored."""
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def _lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, *,
                zerokl_routing: RoutingSink | None = None, zerokl_score: ScoreTokens | None = None, **kwargs):
    """Canonical replacement for `LlamaForCausalLM.forward` (and Qwen2/Qwen3/Qwen3-MoE): float32 logits, or
    with zerokl_score the scored positions' log-probs (TokenScoresOutput).

    Sequences are right-padded; `attention_mask` is accepted for API compatibility (padding never
    changes the values at real positions, because every row only sees its own earlier tokens). Packed
    sequences come as Hugging Face's padding-free layout: one row [1, N] with `position_ids` restarting
    at 0 for each sequence; each is scored as if alone (kernels.packed_attention.packed_lengths).
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
    hidden = forward_hidden(self, ids, position_ids, ops=CANONICAL_OPS, routing=routing,
                            sequence_lengths=packed_lengths(position_ids))
    if zerokl_score is None:
        return CausalLMOutputWithPast(logits=_in_lm_head_call(self, hidden, CANONICAL_OPS.logits))
    return _score(self, ids, hidden, zerokl_score)


def _in_lm_head_call(model, hidden: torch.Tensor, head):
    """head(hidden, the lm head's bf16 weight), run as the lm head module's own call.

    Rule: the head's weight is read only inside that call. A trainer may shard the lm head under FSDP2 as a unit
    of its own (verl does, for an untied head): only its call's hooks unshard the weight (outside it is the
    sharded DTensor, or storage already freed) and reduce its gradient into the sharded parameter."""
    module = model.lm_head
    own_forward = module.__dict__.get("forward")
    module.forward = lambda h: head(h, lm_head_weight(model))
    try:
        return module(hidden)
    finally:
        if own_forward is None:
            del module.forward
        else:
            module.forward = own_forward


def _score(model, ids: torch.Tensor, hidden: torch.Tensor, score: ScoreTokens) -> TokenScoresOutput:
    if not isinstance(score, ScoreTokens):
        raise TypeError(f"zerokl_score must be a ScoreTokens, got {type(score).__name__}")
    where = score.positions
    if where.dtype != torch.bool or where.shape != (ids.shape[0], ids.shape[1] - 1):
        raise ValueError(f"ScoreTokens.positions must be bool [B, T-1] = {(ids.shape[0], ids.shape[1] - 1)}, got "
                         f"{where.dtype} {tuple(where.shape)}")
    where = where.to(ids.device)
    logp, ent = _in_lm_head_call(model, hidden[:, :-1][where], lambda h, weight: K.head_token_logprobs(
        h, weight, score.temperature, ids[:, 1:][where], entropy=score.entropy, vocab_limit=score.vocab_limit))
    zeros = torch.zeros(where.shape, dtype=torch.float32, device=ids.device)
    return TokenScoresOutput(log_probs=zeros.masked_scatter(where, logp),
                             entropy=None if ent is None else zeros.masked_scatter(where, ent))


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
    # an FSDP2-sharded weight is placed by FSDP2 at its module's call (with CPU offload it waits on the CPU)
    if input_ids.device != weight.device and weight.device.type != "meta" and not isinstance(weight, DTensor):
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
