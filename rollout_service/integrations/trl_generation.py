"""TRL's colocated vLLM generation with the canonical model, zerokl's sampling processor and one seeded
request per sample (rollout_service.integrations.trl builds it on first use: importing this module needs
TRL and vLLM)."""
from __future__ import annotations

import contextlib
import hashlib
import os

import torch

from rollout_service.vllm.plugin.sampling import EXTRA_ARGS_KEY

_MAX_SEED = 2 ** 63


def sample_seed(base_seed: int, mode: str, step: int, call: int, group: int, prompt_ids, index: int) -> int:
    """A seed in [0, 2**63) from everything that identifies one sample of one generation."""
    key = repr((int(base_seed), mode, int(step), int(call), int(group), [int(t) for t in prompt_ids], int(index)))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % _MAX_SEED


def generation_class():
    """ZeroKLVLLMGeneration, a subclass of TRL's VLLMGeneration."""
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
            hint = _adapter_hint(self.model)
            if hint:  # the adapter's tensors exist before vLLM captures graphs (vllm/plugin/lora.py), and our
                # worker extension takes each sync's adapter (sync_weights)
                from rollout_service.vllm.instance import WORKER_EXTENSION
                options["hf_overrides"] = {**options["hf_overrides"], **hint}
                options["worker_extension_cls"] = WORKER_EXTENSION
            options.update(self.llm_options)
            self.llm = LLM(**options)
            if self.enable_sleep_mode:
                self.llm.sleep(level=2)
            self._llm_weights_sleeping = self.enable_sleep_mode
            acc.wait_for_everyone()

        def sync_weights(self):
            """A PEFT model: its LoRA adapter alone into the canonical vLLM model (the base never changes there:
            TRL's own sync would merge the adapter into the weights, which is not the trainer's forward)."""
            from accelerate.utils import is_peft_model

            model = self.accelerator.unwrap_model(self.model)
            if not is_peft_model(model):
                return super().sync_weights()
            if self._dist.is_fsdp or self._dist.is_zero3:
                raise NotImplementedError("zerokl's TRL integration syncs PEFT adapters of unsharded models only")
            from rollout_service.lora import adapter_from_model
            if self.enable_sleep_mode:
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            adapter = adapter_from_model(model)
            self.llm.collective_rpc("zerokl_load_adapter", args=(adapter.settings(), dict(adapter.tensors)))
            self.llm.reset_prefix_cache()  # its KV was computed with the last adapter

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

    return ZeroKLVLLMGeneration


def _adapter_hint(model) -> dict:
    """hf_overrides that size a PEFT model's LoRA adapter in the vLLM model at load time; {} otherwise."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return {}
    from rollout_service.vllm.plugin.lora import lora_hint
    return lora_hint(config.r, config.lora_alpha, config.target_modules)
