"""One vllm.LLM on a checkpoint, through vLLM's public offline API only: built with the project's
options (the plugin's canonical model, or vLLM's stock model and sampler), fed weights in place,
put to sleep and woken. VLLMEngine builds its engines from it; the native engine's vLLM proposer
(vllm.proposer) drafts with one; vllm.requests puts requests in its terms.

Weights reach vLLM through `worker_extension_cls` + `LLM.collective_rpc`. `import vllm` happens only
when a VLLMInstance is built, so `import rollout_service` works without vLLM installed.
"""
from __future__ import annotations

import gc
import os
import shutil
import tempfile

import torch

from rollout_service.vllm.plugin import HF_OVERRIDES, compat, pick_runner, require_entry_point, runner_options
from rollout_service.vllm.plugin.sampling import CAPTURE, PROCESSOR_FQCN
from rollout_service.vllm.plugin.tensor_parallel import tp_options

WORKER_EXTENSION = f"{__name__}.VLLMWorkerExtension"
SLEEP_TAGS_ORDER = ("weights", "kv_cache")  # vLLM's tags of the memory a sleep releases, in the order they wake
SLEEP_TAGS = frozenset(SLEEP_TAGS_ORDER)


class EngineWakeOutOfMemory(RuntimeError):
    """vLLM's wake could not map the engine's memory back: the GPU it shares (with a trainer rank, in the
    GRPO recipe's colocated placement) lacks room for the engine's share. What stayed asleep wakes on the
    next wake, which retries it."""


# What a failed wake asks of the run. The names are the GRPO recipe's keys (recipes.config); the engine's
# own options are the same names under rollout.engine.
WAKE_KNOBS = ("a smaller engine share (rollout.engine.gpu_memory_utilization, or "
              "rollout.engine.vllm_options.kv_cache_memory_bytes: the KV cache to the rollout's need), less "
              "held by the trainer rank on the same GPU when the engine wakes (trainer.num_ranks shards its "
              "weights, gradients and AdamW states; trainer.max_tokens_per_micro_batch and "
              "trainer.activation_checkpointing bound its activations), or rollout.sleep_while_training=false "
              "where the engine and the rank fit side by side")


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError, or vLLM's sleep-mode allocator failing to map memory back: its C
    extension (cumem_allocator) raises a RuntimeError "CUDA Error: out of memory at ..." (vLLM 0.25-0.32)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


class VLLMWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); reached with `LLM.collective_rpc`."""

    def zerokl_stage_weights(self, named_tensors=None, path: str | None = None) -> int:
        """Tensors by reference (in-process engine) or a safetensors file (worker processes)."""
        if path is not None:
            from safetensors.torch import load_file
            named_tensors = list(load_file(path).items())
        staged = self.__dict__.setdefault("_zerokl_staged", [])
        staged.extend(named_tensors)
        return len(staged)

    def zerokl_load_weights(self, named_tensors) -> int:
        """Tensors (by reference: in-process engines only) straight into the model, in place."""
        model = _worker_model(self)
        with compat.lora_wrappers_lifted(model):
            model.load_weights(iter(named_tensors))
        return len(named_tensors)

    def zerokl_load_adapter(self, settings: dict, tensors: dict) -> int:
        """A LoRA adapter (rollout_service.lora.LoraAdapter's settings and tensors) applied to every token from
        the next step on (vllm/plugin/lora.py); returns its bytes. Then reset_prefix_cache(), as after any
        weight load: cached KV was computed with the old adapter."""
        from rollout_service.lora import LoraAdapter
        model = _worker_model(self)
        return model.load_adapter(LoraAdapter.from_settings(settings, tensors))

    def zerokl_commit_weights(self) -> int:
        """Loads the staged (checkpoint-format) weights with vLLM's in-place reload."""
        staged = self.__dict__.pop("_zerokl_staged", [])
        model = _worker_model(self)
        with compat.lora_wrappers_lifted(model):
            self.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
        return len(staged)

    def zerokl_capture(self, on: bool) -> list[dict]:
        records, CAPTURE["records"] = CAPTURE["records"], []
        CAPTURE["on"] = bool(on)
        return records


def _worker_model(worker) -> torch.nn.Module:
    return worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def sized_options(llm_options: dict, gpu_share: float) -> dict:
    """vllm.LLM options with our defaults where the caller set none: on CPU eager mode, blocks of 32
    tokens and a 1 GiB KV cache; on GPU `gpu_share` of the GPU's memory."""
    options = dict(llm_options)
    sized = {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(options)
    if _on_cpu():
        options.setdefault("enforce_eager", True)
        options.setdefault("block_size", 32)  # CPU default 128: prefix reuse is per full block
        if not sized:  # vLLM's CPU default (0.9 of the NUMA node's RAM) rarely fits next to us
            options["kv_cache_memory_bytes"] = 1 << 30
    elif not sized:
        options["gpu_memory_utilization"] = gpu_share
    return options


class VLLMInstance:
    """A vllm.LLM built from a checkpoint.

    model: a checkpoint directory / hub id, or a Hugging Face model object (saved to a temp dir).
    Options go to vllm.LLM; defaults here: dtype bfloat16, prefix caching on, no tokenizer; on CPU
    eager mode, block_size 32 and a 1 GiB KV cache; on GPU gpu_memory_utilization=0.4 (a verifier
    may share the GPU) unless gpu_memory_utilization or kv_cache_memory_bytes is given.
    `stock_sampler=True`: vLLM's own sampler and log-probs instead of our rule. With the plugin's
    model class (`hf_overrides=HF_OVERRIDES`) the rule runs on the model runner vLLM picks
    (`self.runner`, vllm.plugin.pick_runner); a stock class takes it as a V1 logits processor.
    `in_process=True` runs vLLM's engine core in this process (uniprocess executor: weights pass as
    tensors); vLLM's CPU worker then makes torch.set_num_threads a no-op process-wide. False gives it
    its own process, as vLLM does by default (the plugin's model class is then found through the
    package's entry point). `tensor_parallel_size` > 1: vLLM's worker processes, one per rank
    (vllm.plugin.tensor_parallel); weights then reach them through files. `logits_processor`: the
    processor class (or "module:Class"); the default applies kernels.sample. `capture()` records what
    the processor saw (all LLMs of the process). `runner`: the canonical model's runner where the caller
    has already picked it (pick_runner reads the checkpoint's config).
    """

    def __init__(self, model, *, max_model_len: int | None = None, dtype: str = "bfloat16",
                 in_process: bool = True, logits_processor=None, seed: int = 0,
                 weight_chunk_bytes: int = 1 << 29, stock_sampler: bool = False, tensor_parallel_size: int = 1,
                 runner: str | None = None, **llm_options):
        self._tmpdir = None
        if isinstance(model, (str, os.PathLike)):
            path = str(model)
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="zerokl-vllm-")
            model.save_pretrained(self._tmpdir)
            path = self._tmpdir
        canonical = (llm_options.get("hf_overrides") or {}).get("architectures") == HF_OVERRIDES["architectures"]
        if canonical and (tensor_parallel_size != 1 or not in_process):
            require_entry_point()  # vLLM's own processes find the canonical model through it
        # k > 1: vLLM's worker processes (mp executor), the checkpoint checked for a k-way split first
        llm_options.update(tp_options(path if canonical else None, tensor_parallel_size))
        if in_process:
            llm_options.setdefault("distributed_executor_backend", "uni")
        # tensors can be handed over only to an engine core and model runner in this process
        self.in_process = in_process and llm_options.get("distributed_executor_backend") == "uni"
        # weights by reference straight into the model (in-process engines whose model takes them in place)
        self.loads_in_place = self.in_process and (canonical or compat.stock_loads_in_place())
        llm_options = sized_options(llm_options, gpu_share=0.4)  # the verifier shares the GPU
        from vllm import LLM
        self.weight_chunk_bytes = weight_chunk_bytes
        # the sampling rule's carrier: our logits processor on vLLM's V1 runner (a stock model class,
        # or a caller's processor, keeps vLLM there), the canonical model's own sampler on V2
        if stock_sampler:
            self.runner, sampler = None, dict(logprobs_mode="processed_logprobs")
        elif logits_processor is not None or not canonical:
            self.runner, sampler = "v1", dict(logits_processors=[logits_processor or PROCESSOR_FQCN],
                                              logprobs_mode="processed_logits")
        else:
            self.runner = runner or pick_runner(path)
            sampler = runner_options(self.runner)
        compat.allow_graph_capture()  # an earlier engine of this process may have cleared it
        with compat.engine_core_placement(own_process=not in_process):
            self.llm = LLM(model=path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                           skip_tokenizer_init=True, enable_prefix_caching=True,
                           worker_extension_cls=WORKER_EXTENSION, **sampler, **llm_options)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self._sleep_mode = bool(llm_options.get("enable_sleep_mode")) and not _on_cpu()
        self._asleep_tags: frozenset[str] = frozenset()  # vLLM's memory tags released by sleep, not woken
        self._weights_generation = 0  # see prompt()
        self._staged = False  # a bucketed push's tensors wait for finish_weight_load (load_named_weights)

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, state_dict) -> None:
        """Load a Hugging Face-named state dict into vLLM's model (vLLM's in-place reload, through
        the worker extension) and start a new weights generation (see prompt)."""
        items = state_dict.items() if hasattr(state_dict, "items") else state_dict
        named = []
        for name, tensor in items:
            t = tensor.detach()
            if hasattr(t, "full_tensor"):  # DTensor from FSDP2
                t = t.full_tensor()
            named.append((name, t))
        if self.in_process:
            self.llm.collective_rpc("zerokl_stage_weights", args=(named,))
        else:  # collective_rpc is for control messages: pass files, in chunks
            self._stage_through_files(named)
        self.llm.collective_rpc("zerokl_commit_weights")
        self._weights_generation += 1

    def load_named_weights(self, named) -> None:
        """Part of a bucketed push: in place now (loads_in_place), or staged until finish_weight_load,
        which loads the staged tensors with vLLM's in-place reload: host copies, by reference for an
        engine core in this process (the push's buffers may be written again before then), else
        through files."""
        if self.loads_in_place:
            self.llm.collective_rpc("zerokl_load_weights", args=(list(named),))
        elif self.in_process:
            self.llm.collective_rpc("zerokl_stage_weights", args=([(n, t.to("cpu", copy=True)) for n, t in named],))
        else:
            self._stage_through_files(named)
        self._staged = not self.loads_in_place

    def add_adapter(self, request) -> None:
        """Serve vLLM's LoRARequest `request` (its PEFT checkpoint read now; an error raises here, and then
        nothing changed); later prompts get a new weights generation, since KV cached under the adapter's
        name before may have been computed with other tensors (see prompt)."""
        self.llm.llm_engine.add_lora(request)
        self._weights_generation += 1

    def remove_adapter(self, lora_int_id: int) -> None:
        self.llm.llm_engine.remove_lora(lora_int_id)

    def finish_weight_load(self) -> None:
        """The push is complete: staged tensors are loaded now, and later prompts get the new weights' salt."""
        if self._staged:
            self._staged = False
            self.llm.collective_rpc("zerokl_commit_weights")
        self._weights_generation += 1

    # Rule: KV computed with replaced weights is never reused. Each load of weights starts a new
    # generation, and every prompt carries its generation as vLLM's cache_salt (part of the first
    # block's hash, and so of every block's after it): a prefix cached before the load cannot match a
    # prompt after it. vLLM's reset_prefix_cache would do the same by walking every KV block on the
    # host, a cost that grows with the cache; stale blocks are instead evicted as any free block is.
    def prompt(self, prompt_token_ids: list[int]) -> dict:
        """vLLM's tokens prompt, salted with the current weights' generation."""
        return {"prompt_token_ids": prompt_token_ids, "cache_salt": f"zerokl-weights-{self._weights_generation}"}

    def _stage_through_files(self, named) -> None:
        from safetensors.torch import save_file
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(prefix="zerokl-weights-", dir=shm) as tmp:
            chunk, size, k = {}, 0, 0
            for i, (name, t) in enumerate(named):
                chunk[name] = t.to("cpu", copy=True).contiguous()
                size += t.numel() * t.element_size()
                if size >= self.weight_chunk_bytes or i == len(named) - 1:
                    path = os.path.join(tmp, f"{k}.safetensors")
                    save_file(chunk, path)
                    self.llm.collective_rpc("zerokl_stage_weights", kwargs={"path": path})
                    os.remove(path)
                    chunk, size, k = {}, 0, k + 1

    # -- extras ---------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode on engines built with enable_sleep_mode=True on a GPU (otherwise nothing to
        release): level 1 frees the KV cache and offloads the weights to pinned host memory; level 2
        discards the weights too (the caller must load every weight again before the next step)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self._sleep_mode and not self._asleep_tags:
            self.llm.sleep(level=level)
            self._asleep_tags = SLEEP_TAGS

    @property
    def sleeping(self) -> bool:
        return bool(self._asleep_tags)

    # Rule: a wake after a partial one names the tags it maps, and the weights come back first. vLLM
    # 0.25 maps every allocation of the tags it is given (all of them when given none), awake or not,
    # so a wake of all tags after a wake of the weights alone would map them twice; and its first wake
    # after a level-2 sleep writes the model's saved buffers back into the weights' memory.
    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Map the memory the last sleep released again: all of it, or only `tags` of vLLM's ("weights",
        "kv_cache"); the engine serves again once nothing is left asleep."""
        waking = self._asleep_tags if tags is None else self._asleep_tags & set(tags)
        if "kv_cache" in waking and "weights" in self._asleep_tags - waking:
            raise ValueError("the weights wake first (see the rule above)")
        if waking:
            try:
                self.llm.wake_up(tags=None if waking == SLEEP_TAGS else sorted(waking, key=SLEEP_TAGS_ORDER.index))
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                raise EngineWakeOutOfMemory(
                    f"vLLM's wake ran out of GPU memory mapping {' and '.join(sorted(waking))} back ({e}). "
                    f"Make room with {WAKE_KNOBS}.") from e
            self._asleep_tags -= waking

    def capture(self, on: bool = True) -> list[dict]:
        """Switch recording of (params, position, logits row, chosen token, log-prob) per processed
        row on or off; returns the records kept since the previous call (first worker)."""
        records = self.llm.collective_rpc("zerokl_capture", args=(on,))[0]
        for r in records:  # kept as floats in the worker (plain data crosses processes)
            r["logits"] = torch.tensor(r["logits"], dtype=torch.float32)
        return records

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:  # an in-process engine core frees weights, KV cache and graphs only now
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
