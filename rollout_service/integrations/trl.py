"""TRL's GRPOTrainer (vLLM colocate mode) with a rollout/train log-prob difference of exactly 0.

    from rollout_service.integrations.trl import GRPOTrainer   # instead of trl.GRPOTrainer
    trainer = GRPOTrainer(model=path, reward_funcs=..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))

What changes against TRL's own trainer (TRL 1.16):
- vLLM runs the canonical model (`hf_overrides=HF_OVERRIDES`) and our seeded Gumbel processor (vLLM at
  temperature 0, `logprobs_mode="processed_logits"`). Each sample's seed is a hash of a base seed (`zerokl_seed`,
  default `args.seed`), train/eval, the global step, the generation's index within that step, the data-parallel
  group, the prompt's token ids and the sample's index among equal prompts of the batch: the G completions of a
  prompt differ and a run repeats bit for bit.
- The trainer's per-token log-probs (old and current policy, reference model) come from the canonical forward
  (trainer_patch.patch_model + kernels.token_logprobs) at the same temperature; TRL's left-padded rows are
  shifted to start at column 0, so their tokens get positions 0.. as in the rollout.
- Weights reach vLLM through TRL's own `sync_weights` (`model.load_weights([(name, tensor)])`, one tensor per
  call), which ZeroKLForCausalLM copies in place.
- The behaviour policy's log-probs are the rollout's: they are the trainer's bits under the weights that
  sampled, so TRL's no-grad pass that recomputes them ("old" log-probs) and its importance-sampling correction
  (a factor of exactly 1.0) are skipped. The rollout/train difference is measured instead from the forward the
  update runs anyway, while the weights are still those that sampled, and logged under TRL's own names:
  `sampling/sampling_logp_difference/{mean,max}` = 0.0 and `sampling/importance_sampling_ratio/*` = 1.0 at every
  step. `keep_trl_correction=True` keeps TRL's pass and correction (then TRL logs the same metrics itself).
Unsupported (a clear error): other TRL versions, vLLM server mode, tensor parallelism > 1,
images, PEFT, min_p, repetition_penalty != 1, generation_kwargs.
"""
from __future__ import annotations

import contextlib

import torch

from .versions import check_version

# Verified against TRL 1.16.0: trl/trainer/grpo_trainer.py (GRPOTrainer.__init__ builds VLLMGeneration,
# _get_per_token_logps_and_entropies scores through add_fused_lm_head) and trl/generation/vllm_generation.py.
SUPPORTED_TRL = ((1, 16), (1, 17))  # [lower, upper)


def check_trl_version() -> str:
    """The installed TRL version; raises ImportError outside SUPPORTED_TRL."""
    return check_version("trl", SUPPORTED_TRL, "trl", "pip install 'trl==1.16.*'")


def left_to_right_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Rolls each row left by its number of leading pads; returns (ids, mask, gather index back)."""
    mask = attention_mask.bool()
    lead = (~mask).long().cumprod(1).sum(1)  # leading pads per row
    width = input_ids.shape[1]
    cols = torch.arange(width, device=input_ids.device)
    forward_index = (cols.unsqueeze(0) + lead.unsqueeze(1)) % width  # new[j] = old[j + lead]
    ids = input_ids.gather(1, forward_index)
    new_mask = mask.gather(1, forward_index)
    if bool((new_mask[:, 1:] & ~new_mask[:, :-1]).any()):
        raise ValueError("each row's real tokens must be contiguous (left-padded prompt, right-padded completion)")
    back_index = (cols.unsqueeze(0) - lead.unsqueeze(1)) % width  # old[j] = new[j - lead]
    return ids, new_mask, back_index


def canonical_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep: int, temperature: float,
                                  compute_entropy: bool = False):
    """[B, logits_to_keep] log-probs (and entropies) of the last logits_to_keep tokens of TRL's layout under the
    canonical forward, 0 at padding. `model` may be wrapped (DDP); its forward must be patch_model's. Only the
    completion's real tokens pass through the lm head (trainer_patch.ScoreTokens), as in TRL's fused lm head."""
    from trainer_patch import ScoreTokens

    ids, mask, back = left_to_right_padded(input_ids, attention_mask)
    # old column c's log-prob sits at new column c - lead - 1; completion columns are > lead (non-empty prompt)
    keep = (back[:, 1:] - 1)[:, -logits_to_keep:].clamp(min=0)
    valid = mask[:, 1:]  # right padding: positions 0.. per row, as in the rollout
    scored = torch.zeros_like(valid).scatter_(1, keep, True) & valid
    out = model(input_ids=ids, zerokl_score=ScoreTokens(scored, float(temperature), entropy=compute_entropy))
    entropy = out.entropy.gather(1, keep) if compute_entropy else None
    return out.log_probs.gather(1, keep), entropy


def _patch(model: torch.nn.Module) -> None:
    """Make the (unwrapped) HF model's forward the canonical one; replaces TRL's fused-LM-head forward, whose
    only caller, _get_per_token_logps_and_entropies, our trainer overrides. A PEFT model (peft_config=...):
    its base model is patched, and the canonical forward runs the LoRA layers (kernels/lora.py)."""
    import trainer_patch
    if hasattr(model, "peft_config"):
        from rollout_service.lora import adapter_from_model
        for name, config in model.peft_config.items():
            if getattr(config, "lora_dropout", 0.0):
                raise ValueError(f"PEFT adapter {name!r} has lora_dropout={config.lora_dropout}: dropout makes the "
                                 f"trainer's forward differ from the rollout's; use LoraConfig(lora_dropout=0.0)")
        adapter_from_model(model)  # AdapterError for settings the canonical forward does not run (DoRA, ...)
        model = model.get_base_model()
    trainer_patch.patch_model(model)


def _build(trl_module):
    """Classes built on first use, so that importing this module needs neither TRL nor vLLM."""
    from .trl_generation import generation_class

    ZeroKLVLLMGeneration = generation_class()

    class GRPOTrainer(trl_module.GRPOTrainer):
        """trl.GRPOTrainer whose vLLM rollouts and trainer log-probs are zerokl's canonical ones.

        Extra arguments: zerokl_seed (the base of every sample's seed; default args.seed), vllm_kwargs (more
        vllm.LLM options, e.g. kv_cache_memory_bytes / max_num_batched_tokens on CPU) and keep_trl_correction
        (run TRL's old-log-prob pass and importance-sampling correction, which are exact no-ops here).
        """

        def __init__(self, *args, zerokl_seed: int | None = None, vllm_kwargs: dict | None = None,
                     keep_trl_correction: bool = False, **kwargs):
            check_trl_version()
            config = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
            if config is None or not config.use_vllm or config.vllm_mode != "colocate":
                raise ValueError("zerokl's GRPOTrainer needs GRPOConfig(use_vllm=True, vllm_mode='colocate')")
            options = dict(vllm_kwargs or {})
            generation_cls = type("ZeroKLVLLMGeneration", (ZeroKLVLLMGeneration,), {"llm_options": options})
            with _vllm_generation_class(generation_cls):
                super().__init__(*args, **kwargs)
            self.vllm_generation.trainer = self
            self.vllm_generation.base_seed = self.args.seed if zerokl_seed is None else int(zerokl_seed)
            _patch(self.accelerator.unwrap_model(self.model))
            if self.ref_model is not None:
                _patch(self.ref_model)
            # VESPO reads the correction's ratio inside its loss: it keeps TRL's path
            self._rollout_is_behaviour = not keep_trl_correction and self.loss_type != "vespo"
            if self._rollout_is_behaviour:
                self.vllm_importance_sampling_correction = False
            self._loss_inputs = None  # the batch whose loss is being computed, for the difference metrics

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self._rollout_is_behaviour:
                rollout = output["sampling_per_token_logps"]
                output["old_per_token_logps"] = rollout  # exact: the weights that sampled scored these bits
                # the optimizer step the weights were at when this batch was sampled, one entry per row so that
                # TRL's batch splitting and shuffling carry it along
                output["zerokl_sampled_at_step"] = torch.full((rollout.size(0),), self.state.global_step,
                                                              device=rollout.device)
            return output

        def _compute_loss(self, model, inputs):
            self._loss_inputs = inputs
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._loss_inputs = None

        def _log_rollout_difference(self, logps: torch.Tensor) -> None:
            """TRL's mismatch metrics from the update's own forward, while the weights are still those that
            sampled (with num_iterations > 1, later passes see updated weights and are not a mismatch)."""
            inputs = self._loss_inputs
            if inputs is None or not bool((inputs["zerokl_sampled_at_step"] == self.state.global_step).all()):
                return
            mask = inputs["completion_mask"].bool()
            if "tool_mask" in inputs:
                mask &= inputs["tool_mask"].bool()
            diff = (logps.detach() - inputs["sampling_per_token_logps"])[mask]
            if diff.numel() == 0:  # still gathered below: every rank takes part in the collectives
                diff = logps.new_zeros(1)
            gather = self.accelerator.gather
            delta, ratio = diff.abs(), diff.exp()
            metrics = self._metrics["train" if self.model.training else "eval"]
            metrics["sampling/sampling_logp_difference/mean"].append(gather(delta.mean()).mean().item())
            metrics["sampling/sampling_logp_difference/max"].append(gather(delta.max()).max().item())
            metrics["sampling/importance_sampling_ratio/min"].append(gather(ratio.min()).min().item())
            metrics["sampling/importance_sampling_ratio/mean"].append(gather(ratio.mean()).mean().item())
            metrics["sampling/importance_sampling_ratio/max"].append(gather(ratio.max()).max().item())

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):
            if any(v is not None for v in multimodal.values()):
                raise NotImplementedError("zerokl's TRL integration does not support multimodal inputs")
            if compute_aux_loss:
                raise NotImplementedError("zerokl's TRL integration does not support MoE models")
            batch_size = batch_size or input_ids.size(0)
            logps, entropies = [], []
            for start in range(0, input_ids.size(0), batch_size):
                lp, ent = canonical_logps_and_entropies(
                    model, input_ids[start:start + batch_size], attention_mask[start:start + batch_size],
                    logits_to_keep, self.temperature, compute_entropy)
                logps.append(lp)
                entropies.append(ent)
            logps = torch.cat(logps)
            if self._rollout_is_behaviour and torch.is_grad_enabled():
                self._log_rollout_difference(logps)
            return logps, (torch.cat(entropies) if compute_entropy else None), None

    return ZeroKLVLLMGeneration, GRPOTrainer


@contextlib.contextmanager
def _vllm_generation_class(cls):
    """The one monkeypatch: GRPOTrainer.__init__ builds its vLLM backend as `VLLMGeneration(...)`, a global of
    trl.trainer.grpo_trainer, with no constructor argument to choose the class; swapping it for the duration of
    __init__ avoids building (and loading weights into) a stock engine only to replace it."""
    import trl.trainer.grpo_trainer as grpo_module
    original = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = cls
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = original


_CLASSES: dict[str, type] = {}


def __getattr__(name: str):
    if name in ("GRPOTrainer", "ZeroKLVLLMGeneration"):
        if not _CLASSES:
            check_trl_version()
            import trl
            _CLASSES["ZeroKLVLLMGeneration"], _CLASSES["GRPOTrainer"] = _build(trl)
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
