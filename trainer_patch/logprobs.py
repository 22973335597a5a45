"""Per-token log-probs under the canonical forward (the numbers the rollout engine reports)."""
from __future__ import annotations

import torch

from kernels.moe import is_moe_block

from .patch import RoutingSink, ScoreTokens, check_input_ids, is_patched, patch_model


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0, routing: list | None = None,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B, T-1]: log p(input_ids[:, t+1] | input_ids[:, :t+1]) at the rollout's temperature.

    `temperature` is the one the rollout sampled with (0 for greedy: log-probs at T = 1, the rule of
    kernels.logprobs). Right padding (per attention_mask) does not change values at real positions;
    padded positions are 0. Differentiable (canonical forward, ordinary backward). Patches `model`
    if it is not yet.

    routing: a list that receives, from this same forward, each MoE layer's expert ids [B, T, k]
    (increasing ids; row t routed the hidden state whose logits score token t + 1, as a rollout's
    routed_experts records it). Nothing is appended for a dense model.

    position_ids: packed sequences, Hugging Face's padding-free layout: input_ids [1, N] holds the sequences
    back to back and position_ids [1, N] restarts at 0 for each (no attention_mask). Each sequence's
    log-probs are the ones it gets scored alone, bit for bit; the position before a sequence's first
    token (it would score the next sequence's start) is 0, like padding.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0 \
            or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    ids = check_input_ids(model, input_ids)
    if ids.shape[1] < 2:
        raise ValueError("input_ids need at least 2 tokens per row to have a next-token log-prob")
    if position_ids is not None:
        if attention_mask is not None:
            raise ValueError("packed sequences (position_ids) take no attention_mask")
        if position_ids.shape != ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} != input_ids {tuple(ids.shape)}")
        position_ids = position_ids.to(ids.device)
    elif attention_mask is not None:
        if attention_mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(ids.shape)}")
        mask = attention_mask.to(ids.device).bool()
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ValueError("attention_mask must be right-padded (1s then 0s per row)")
    if routing is not None and not isinstance(routing, list):
        raise TypeError(f"routing must be a list, got {type(routing).__name__}")
    if not is_patched(model):
        patch_model(model)
    extra = {} if routing is None else {"zerokl_routing": RoutingSink(routing)}
    # only real positions pass through the lm head; the rest stay 0
    scored = _scored_positions(ids, attention_mask, position_ids)
    if position_ids is not None:
        extra["position_ids"] = position_ids
    return model(input_ids=ids, zerokl_score=ScoreTokens(scored, float(temperature)), **extra).log_probs


def _scored_positions(ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None) -> torch.Tensor:
    """[B, T-1] bool: position t scores token t + 1 of the same sequence."""
    if position_ids is not None:  # a packed row: t + 1 must not start the next sequence
        return position_ids[:, 1:] != 0
    if attention_mask is not None:
        return attention_mask.to(ids.device).bool()[:, 1:]
    return torch.ones_like(ids[:, 1:], dtype=torch.bool)


def stock_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                         temperature: float = 1.0, position_ids: torch.Tensor | None = None,
                         routing: list | None = None) -> torch.Tensor:
    """The same quantity from an unpatched Hugging Face model, the way stock RL trainers compute it
    (the stock arm of the recipe): its own forward (SDPA attention, cuBLAS matmuls), logits in
    float32 divided by the temperature (greedy: 1), log_softmax, gathered at the next tokens. It does
    not equal a rollout engine's log-probs bit for bit; that difference is what the recipe measures.

    position_ids: packed sequences in one row, as in token_logprobs; transformers turns the restarting
    positions into a block-diagonal causal mask (or varlen flash attention), its padding-free path.

    routing: as in token_logprobs, each MoE layer's expert ids [B, T, k] (increasing), the ones the model's
    own routers picked in this forward, so a stock trainer's routing can be set beside the rollout's."""
    hooks = [] if routing is None else _record_stock_routing(model, routing, input_ids.shape)
    try:
        if position_ids is not None:
            _check_stock_packing()
            position_ids = position_ids.to(input_ids.device)
            # use_cache=False: with a KV cache transformers skips its packed-sequence detection, and every token
            # would attend to the sequences before it in the row
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[:, :-1].float()
        else:
            logits = model(input_ids=input_ids,
                           attention_mask=attention_mask.to(input_ids.device)).logits[:, :-1].float()
    finally:
        for hook in hooks:
            hook.remove()
    logp = torch.log_softmax(logits / (float(temperature) or 1.0), dim=-1)
    logp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.where(_scored_positions(input_ids, attention_mask, position_ids), logp, 0.0)


def _record_stock_routing(model: torch.nn.Module, routing: list, shape: torch.Size) -> list:
    """Forward hooks on the MoE blocks' routers that append each one's expert ids [B, T, k] (increasing) to
    `routing`; the caller removes them. A hook, not transformers' `output_router_logits`: its output recorder
    registers a model class when an instance is built, so a model unpickled in another process (a Ray actor's)
    records nothing."""
    blocks = [layer.mlp for layer in model.model.layers if is_moe_block(layer.mlp)]
    k = getattr(model.config, "num_experts_per_tok", None)
    if not blocks or k is None:
        raise ValueError(f"{type(model).__name__} has no MoE blocks: routing is recorded for MoE models only")
    b, t = shape

    def record(module, inputs, out):
        if isinstance(out, tuple):  # transformers 5's routers: (logits, weights, expert ids)
            ids = out[2]
        else:  # a linear gate (transformers 4): its block takes the top k of the logits' softmax
            ids = torch.topk(torch.softmax(out.detach().float(), dim=-1), k, dim=-1).indices
        routing.append(ids.detach().sort(dim=-1).values.reshape(b, t, k))
    return [block.gate.register_forward_hook(record) for block in blocks]


def _check_stock_packing() -> None:
    """transformers reads packed rows from restarting position_ids since its masking_utils learnt to
    (find_packed_sequence_indices); an older release would let sequences attend to each other."""
    import transformers
    import transformers.masking_utils as masking
    if not hasattr(masking, "find_packed_sequence_indices"):
        raise RuntimeError(f"transformers {transformers.__version__} cannot score packed rows with the stock "
                           "forward: set trainer.batching.packing=false, or upgrade transformers")
