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
import hashlib
import os
from importlib.metadata import PackageNotFoundError, version

import torch

from rollout_service.vllm.plugin.sampling import EXTRA_ARGS_KEY

# Verified against TRL 1.16.0: trl/trainer/grpo_trainer.py (GRPOTrainer.__init__ builds VLLMGeneration,
# _get_per_token_logps_and_entropies scores through add_fused_lm_head) and trl/generation/vllm_generation.py.
SUPPORTED_TRL = ((1, 16), (1, 17))  # [lower, upper)
_MAX_SEED = 2 ** 63


def check_trl_version() -> str:
    """The installed TRL version; raises ImportError outside SUPPORTED_TRL."""
    try:
        installed = version("trl")
    except PackageNotFoundError:
        raise ImportError("rollout_service.integrations.trl needs TRL: pip install 'trl==1.16.*'") from None
    parts = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    lo, hi = SUPPORTED_TRL
    if not lo <= parts < hi:
        raise ImportError(f"rollout_service.integrations.trl supports TRL >= {'.'.join(map(str, lo))}, "
                          f"< {'.'.join(map(str, hi))} (it relies on TRL internals checked for those versions); "
                          f"found trl {installed}: pip install 'trl==1.16.*'")
    return installed


def sample_seed(base_seed: int, mode: str, step: int, call: int, group: int, prompt_ids, index: int) -> int:
    """A seed in [0, 2**63) from everything that identifies one sample of one generation."""
    key = repr((int(base_seed), mode, int(step), int(call), int(group), [int(t) for t in prompt_ids], int(index)))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % _MAX_SEED


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
    only caller, _get_per_token_logps_and_entropies, our trainer overrides."""
    import trainer_patch
    if hasattr(model, "peft_config"):
        raise NotImplementedError("zerokl's TRL integration does not support PEFT models yet")
    trainer_patch.patch_model(model)


def _build(trl_module):
    """Classes built on first use, so that importing this module needs neither TRL nor vLLM."""
    from trl.generation.vllm_generation import VLLMGeneration, extract_logprobs

    class ZeroKLVLLMGeneration(VLLMGeneration):
        """TRL's colocate vLLM with the canonical model, our processor and one seeded request per sample."""

        llm_options: dict = {}  # set per trainer (extra vllm.LLM options, e.g. kv_cache_memory_bytes on CPU)
        trainer = None
        base_seed = 0

        def _init_vllm(self):
            if self.mode != "colocate":
                raise NotImplementedError("zerokl's TRL integration supports vllm_mode='colocate' only")
            if self.tensor_parallel_size != 1:
                raise NotImplementedError("zerokl's TRL integration supports vllm_tensor_parallel_size=1 only")
            if self.min_p or self.repetition_penalty != 1.0 or self.generation_kwargs:
                raise NotImplementedError("zerokl's sampling rule supports temperature, top_k and top_p only "
                                          "(no min_p, repetition_penalty or generation_kwargs)")
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
            from trl.trainer.utils import ensure_master_addr_port
            from vllm import LLM

            from rollout_service.vllm.plugin import llm_options, register

            register()  # also done by vLLM's plugin entry point; harmless twice
            acc = self.accelerator
            os.environ["RANK"] = str(acc.process_index)
            os.environ["LOCAL_RANK"] = str(acc.local_process_index)
            os.environ["WORLD_SIZE"] = str(acc.num_processes)
            ensure_master_addr_port()
            options = dict(
                model=self.model.name_or_path, tensor_parallel_size=1, max_model_len=self.max_model_length,
                max_num_seqs=self.max_num_seqs, enable_sleep_mode=self.enable_sleep_mode,
                distributed_executor_backend="external_launcher", seed=acc.process_index,
                max_num_batched_tokens=4096, trust_remote_code=self.trust_remote_code, dtype="bfloat16",
                **llm_options(self.model.name_or_path, cuda_graphs=torch.cuda.is_available()))
            if torch.cuda.is_available():
                options["gpu_memory_utilization"] = self.gpu_memory_utilization
            else:  # CPU's default block of 128 tokens makes prefix reuse rare
                options["block_size"] = 32
            options.update(self.llm_options)
            self.llm = LLM(**options)
            if self.enable_sleep_mode:
                self.llm.sleep(level=2)
            self._llm_weights_sleeping = self.enable_sleep_mode
            acc.wait_for_everyone()

        def generate(self, prompts, images, num_generations, profiler=None):
            from vllm import SamplingParams

            if images is not None and any(i is not None for i in images):
                raise NotImplementedError("zerokl's TRL integration does not support images")
            if self.enable_sleep_mode and self._llm_weights_sleeping:
                self.sync_weights()
            trainer = self.trainer
            mode = "train" if trainer is None or trainer.model.training else "eval"
            step = 0 if trainer is None else trainer.state.global_step
            calls = self.__dict__.setdefault("_zerokl_calls", {})
            call = calls[(mode, step)] = calls.get((mode, step), -1) + 1
            group = self.accelerator.process_index
            seen: dict[tuple, int] = {}
            params = []
            for ids in prompts:
                index = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1  # the k-th copy of this prompt
                cfg = dict(seed=sample_seed(self.base_seed, mode, step, call, group, ids, index),
                           temperature=float(self.temperature), top_k=max(int(self.top_k or 0), 0),
                           top_p=float(1.0 if self.top_p is None else self.top_p), position=len(ids))
                # flat log-probs: no dict per token for the collector (TRL's extract_logprobs reads both)
                params.append(SamplingParams(n=1, temperature=0.0, max_tokens=self.max_completion_length,
                                             logprobs=self.logprobs, flat_logprobs=True,
                                             extra_args={EXTRA_ARGS_KEY: cfg}))
            if self.enable_sleep_mode:
                self.llm.wake_up(tags=["kv_cache"])
            with profiler or contextlib.nullcontext():
                outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params,
                                            use_tqdm=False)
            if self.enable_sleep_mode:
                self.llm.sleep(level=2)
                self._llm_weights_sleeping = True
            prompt_ids = [o.prompt_token_ids for o in outputs]
            completion_ids = [c.token_ids for o in outputs for c in o.outputs]
            logprobs, logprob_token_ids = extract_logprobs(outputs)
            return prompt_ids, completion_ids, logprobs, logprob_token_ids

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
