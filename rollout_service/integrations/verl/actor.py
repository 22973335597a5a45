"""verl's FSDP actor (and reference) scoring tokens with the canonical forward.

verl's FSDPEngineWithLMHead.forward_step computes a micro-batch's per-token log-probs (old, current and
reference policy alike) and hands them to the loss. Four things it does there differ from the rollout side:
its Hugging Face forward with verl's monkey patches (flash-attention varlen over packed sequences, Ulysses),
logits for every position, a flash-attn cross-entropy for the log-probs, and no mask of the ids past the
tokenizer's length, which its vLLM rollout forbids (verl's monkey_patch_compute_logits sets their logits to
-inf before sampling and before the log-prob). Our forward_step replaces all four, keeping verl's layout:

- the micro-batch stays packed as verl packs it (use_remove_padding or not: verl's NO_PADDING layout is one
  jagged row per sequence), and the canonical forward scores each sequence as if alone (kernels.packed_attention),
  so packing never changes a bit;
- only the scored positions pass through the lm head (trainer_patch.ScoreTokens), with the logits of ids
  >= len(tokenizer) at -inf before the canonical log-softmax (kernels.mask_vocab_tail): the rollout's rule;
- log-probs come back as verl's jagged tensors (position t: log p(token t + 1); a sequence's last position 0,
  never read), and go to verl's own loss function.
"""
from __future__ import annotations

import functools

import torch

from .config import enabled


def vocab_limit(model_config, vocab_size: int) -> int | None:
    """The ids verl's vLLM rollout lets the policy sample: those below len(tokenizer) (None: all of a vocabulary
    no larger than the tokenizer's). verl also bans a processor's vision placeholder ids; a text model has none,
    and others raise (the trainer would have to forbid the same ids)."""
    tokenizer = getattr(model_config, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("verl's model config has no tokenizer: the rollout's vocabulary limit is len(tokenizer)")
    processor = getattr(model_config, "processor", None)
    if processor is not None and processor is not tokenizer:
        from verl.utils.tokenizer import get_vision_placeholder_token_ids  # verl's own list
        if get_vision_placeholder_token_ids(processor):
            raise NotImplementedError("zero KL does not run multi-modal models (verl bans their vision placeholder "
                                      "ids in the rollout)")
    limit = len(tokenizer)
    return limit if limit < vocab_size else None


def uniform_temperature(temperature) -> float:
    """verl's micro-batch temperature (a number, or one per sequence) as the one number the canonical head
    takes; per-sequence values must all be equal."""
    if isinstance(temperature, torch.Tensor):
        values = torch.unique(temperature.detach().float().reshape(-1))
        if values.numel() != 1:
            raise NotImplementedError(f"zero KL scores a micro-batch at one temperature, got {values.tolist()}")
        temperature = float(values.item())
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return temperature


def packed_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                          temperature: float, *, vocab_limit: int | None = None, entropy: bool = False):
    """Canonical next-token log-probs (and entropies) of verl's jagged sequences, as one packed row.

    input_ids, position_ids: nested jagged [B, j] (verl's NO_PADDING layout); position_ids must restart at 0 for
    each sequence (the rollout's positions). Returns jagged float32 tensors with input_ids' offsets: position t
    holds log p(token t + 1 | tokens <= t) of its sequence, each sequence's last position 0 (entropy: None unless
    asked). `model` is a patched (trainer_patch) Hugging Face model, under FSDP2 or not."""
    from trainer_patch import ScoreTokens, is_patched, patch_model

    if not (input_ids.is_nested and input_ids.dim() == 2):
        raise ValueError("input_ids must be a jagged nested tensor [B, j] (verl's NO_PADDING layout)")
    offsets = input_ids.offsets()
    flat = input_ids.values()
    lengths = offsets.diff()
    if bool((lengths < 1).any()):
        raise ValueError("every sequence needs at least one token")
    n = flat.shape[0]
    # each token's position within its own sequence: what the rollout engine gave it
    own = torch.arange(n, device=flat.device) - torch.repeat_interleave(offsets[:-1].to(flat.device), lengths.to(flat.device))
    if position_ids is not None:
        given = position_ids.values() if position_ids.is_nested else position_ids.reshape(-1)
        if given.dim() != 1 or not torch.equal(given.to(own.device), own):
            raise NotImplementedError("zero KL needs each sequence's position ids to be 0, 1, ... (multi-modal "
                                      "rope positions are not supported)")
    if not is_patched(model):
        patch_model(model)
    if n < 2:  # one sequence of one token: nothing to score
        zeros = torch.zeros(n, dtype=torch.float32, device=flat.device)
        jag = torch.nested.nested_tensor_from_jagged(zeros, offsets)
        return jag, (jag if entropy else None)
    scored = (own[1:] != 0).unsqueeze(0)  # position t scores token t + 1 only within a sequence
    out = model(input_ids=flat.unsqueeze(0), position_ids=own.unsqueeze(0), use_cache=False,
                zerokl_score=ScoreTokens(scored, temperature, entropy=entropy, vocab_limit=vocab_limit))
    tail = out.log_probs.new_zeros(1)
    log_probs = torch.nested.nested_tensor_from_jagged(torch.cat([out.log_probs[0], tail]), offsets)
    ent = None
    if entropy:
        ent = torch.nested.nested_tensor_from_jagged(torch.cat([out.entropy[0], tail]), offsets)
    return log_probs, ent


def prepare_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under verl's engine, patched to the canonical forward (once). verl turns on
    Hugging Face's activation checkpointing (enable_gradient_checkpointing); it becomes the canonical forward's
    own (trainer_patch.checkpoint_activations: each layer's recompute is the same canonical forward)."""
    import trainer_patch
    from torch.distributed.fsdp import FullyShardedDataParallel
    if isinstance(module, FullyShardedDataParallel):
        raise NotImplementedError("zero KL runs verl's actor under FSDP2 (actor_rollout_ref.actor.strategy=fsdp2)")
    if not trainer_patch.is_patched(module):
        checkpointed = bool(getattr(module, "is_gradient_checkpointing", False))
        if checkpointed:
            module.gradient_checkpointing_disable()
        trainer_patch.patch_model(module)
        if checkpointed:
            trainer_patch.checkpoint_activations(module)
    return module


def compute_device(model: torch.nn.Module) -> torch.device:
    """Where the micro-batch goes: where the weights are, except that FSDP2's CPU offload (verl's reference model)
    keeps the sharded weights on the CPU between calls and computes on the current accelerator, where verl's own
    forward_step sends the batch (`micro_batch.to(get_device_id())`)."""
    from torch.distributed.tensor import DTensor
    weight = model.model.embed_tokens.weight
    if isinstance(weight, DTensor) and weight.device.type == "cpu" and torch.accelerator.is_available():
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return weight.device


def canonical_forward_step(engine, micro_batch, loss_function, forward_only: bool):
    """FSDPEngineWithLMHead.forward_step with the canonical forward: the same inputs and outputs as verl's."""
    from verl.utils import tensordict_utils as tu

    def flag(key, default=False):
        return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)

    for key in ("distillation_use_topk", "distillation_only", "calculate_sum_pi_squared"):
        if flag(key):
            raise NotImplementedError(f"zero KL does not run verl's {key}")
    # verl's agent loop gives every text sample an empty multi_modal_inputs entry: refuse only real ones, read the
    # way verl's own forward_step reads them
    from verl.utils.model import extract_multi_modal_inputs
    if extract_multi_modal_inputs(micro_batch.get("multi_modal_inputs", [])):
        raise NotImplementedError("zero KL does not run multi-modal inputs")
    model = prepare_model(engine.module)
    device = compute_device(model)
    micro_batch = micro_batch.to(device)
    limit = vocab_limit(engine.model_config, model.config.vocab_size)
    # autocast off: the canonical ops choose their own dtypes (bf16 weights, float32 where the rollout has it)
    with torch.autocast(device_type=device.type, enabled=False):
        log_probs, entropy = packed_token_logprobs(
            model, micro_batch["input_ids"], micro_batch["position_ids"],
            uniform_temperature(micro_batch["temperature"]), vocab_limit=limit, entropy=flag("calculate_entropy"))
    model_output = {"log_probs": log_probs}
    if entropy is not None:
        model_output["entropy"] = entropy
    if loss_function is not None:
        loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                      dp_group=engine.get_data_parallel_group())
    else:
        if not forward_only:
            raise ValueError("forward_only must be True when loss_function is None")
        loss, metrics = torch.tensor(1.0, device=device), {}
    detached = {key: value.detach() for key, value in model_output.items()}
    return loss, {"model_output": detached, "loss": loss.detach().item(), "metrics": metrics}


def install(module) -> None:
    """Wraps FSDPEngineWithLMHead.forward_step: engines whose model config turns zero KL on score with
    canonical_forward_step, all others (and value heads, a critic's) keep verl's."""
    lm_head = module.FSDPEngineWithLMHead
    value_head = getattr(module, "FSDPEngineWithValueHead", None)
    original = lm_head.forward_step

    @functools.wraps(original)
    def forward_step(self, micro_batch, loss_function, forward_only):
        if enabled(self.model_config) and not (value_head is not None and isinstance(self, value_head)):
            return canonical_forward_step(self, micro_batch, loss_function, forward_only)
        return original(self, micro_batch, loss_function, forward_only)

    lm_head.forward_step = forward_step
