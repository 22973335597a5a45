"""vLLM's per-request LoRA on the canonical model: `enable_lora=True` with a `LoRARequest` per request, or
`vllm serve --enable-lora --lora-modules NAME=DIR` with the OpenAI `model` field naming the adapter. Each
token runs the adapter its request named (kernels/lora.py's rule), so its log-probs are those of the PEFT
model the adapter was trained in, bit for bit, whatever adapters its batch-mates use.

Why not vLLM's own LoRA manager. Declaring the canonical model `SupportsLoRA` and leaving it to
vllm.lora.worker_manager.LRUCacheWorkerLoRAManager fails three ways:
- its loader accepts only target modules that are vLLM layer classes in the model (LinearBase, FusedMoE:
  vllm.lora.utils.get_supported_lora_modules); the canonical model's projections are Hugging Face modules
  run by kernels.forward, so every PEFT adapter is refused for unexpected target modules;
- it folds the scale into B in bf16 (LoRALayerWeights.optimize: lora_b *= scaling), rounding B · scale,
  where PEFT and the canonical rule round the product once: the bits differ unless the scale is a power of 2;
- its layers compute the product with punica kernels, whose reduction order is not the canonical matmul's.
So for this model the runner's `lora_manager` (what vLLM's LoRAModelRunnerMixin keeps and calls each step)
is `RequestAdapters`, installed by compat.install_lora_manager. The scheduler, `LoRARequest`, `max_loras`,
`max_lora_rank`, `max_cpu_loras` and the server's adapter endpoints stay vLLM's; adapters are read from
their PEFT checkpoints as PEFT wrote them and checked against the base (rollout_service.lora.check_adapter).

Slots: `max_loras` adapters run in a step, each from a slot, applied to the tokens whose request named it
(a token mask per slot, [max tokens] bool on the device, rewritten each step from vLLM's token mapping).
CUDA graphs replay what they captured, so with graphs every slot's tensors exist from the start at the
settings `lora_hint` gives (hf_overrides) and adapters are copied into them; an adapter of other settings is
refused there, and loads only into an eager engine. Hinted slots (eager engines too) hold their A matrices
as extra rows of the base weights (kernels.forward.fuse_projections): each shrink is a part of its base
product, the same bits with no launch of its own.
"""
from __future__ import annotations

import contextlib
import os
from collections import OrderedDict

import numpy as np
import torch

from kernels.forward import fuse_projections
from kernels.lora import LoraRows, LoraWeights
from rollout_service.lora import AdapterError, LoraAdapter, check_adapter, load_adapter, projection_shapes
from rollout_service.vllm.plugin.lora import copy_weights, same_settings, zero_adapter


class RequestAdapters:
    """The LoRA manager of a vLLM runner whose model is the canonical one: the methods vLLM's runner and worker
    call on theirs (vllm.lora.worker_manager.WorkerLoRAManager's), over slots the canonical forward reads."""

    is_enabled = True

    def __init__(self, model: torch.nn.Module, vllm_config):
        lora = vllm_config.lora_config
        self.hf, self.graphs, self.hint = model.hf, model.adapter.graphs, model.adapter.hint
        self.device = torch.device(vllm_config.device_config.device)
        self.max_rank = lora.max_lora_rank
        self.capacity = max(lora.max_cpu_loras or lora.max_loras, lora.max_loras)  # adapters kept loaded
        if self.graphs and not self.hint:
            raise ValueError("enable_lora on the canonical model with CUDA graphs needs the adapters' settings "
                             "before capture: add rollout_service.vllm.plugin.lora_hint(r, alpha, target_modules) "
                             "to hf_overrides, or build the engine with enforce_eager=True")
        self.shapes = projection_shapes(self.hf)
        self.loaded: OrderedDict[int, tuple[str, LoraAdapter]] = OrderedDict()  # lora_int_id -> adapter, LRU first
        self.dummies: set[int] = set()  # vLLM's warm-up adapters: no tensors, their tokens run the base
        self.pinned: set[int] = set()
        self.step_ids: set[int] = set()
        self.slot_ids: list[int | None] = [None] * lora.max_loras
        self.slot_weights: list[LoraWeights | None] = [None] * lora.max_loras
        # hinted: each slot's fixed tensors, zero adapters at the hinted settings, filled in place later (what
        # graphs capture), their A matrices held in the base weights
        self.fixed: list[LoraWeights] = []
        if self.hint:
            zero = zero_adapter(self.hf, self.hint)
            self.fixed = [zero.weights(f"slot{i}", self.device) for i in range(lora.max_loras)]
            fuse_projections(self.hf, tuple(self.fixed))
        if self.graphs:  # every slot takes part in every captured step
            self.slot_weights = list(self.fixed)
        max_tokens = max(vllm_config.scheduler_config.max_num_batched_tokens,
                         max(vllm_config.compilation_config.cudagraph_capture_sizes or [0]))
        self.masks = torch.zeros(lora.max_loras, max_tokens, dtype=torch.bool, device=self.device)

    # ---- what the canonical forward reads ----

    def rows(self, num_tokens: int) -> LoraRows | None:
        """Each filled slot's adapter with its tokens' mask, for a forward of `num_tokens` flat tokens (padding
        included: its mask is False). With graphs every slot takes part, so the captured work is the same."""
        if num_tokens > self.masks.shape[1]:
            raise ValueError(f"a forward of {num_tokens} tokens exceeds the {self.masks.shape[1]} the LoRA token "
                             "masks were sized for (max_num_batched_tokens)")
        pairs = tuple((w, self.masks[i, :num_tokens].view(num_tokens, 1))
                      for i, w in enumerate(self.slot_weights) if w is not None)
        return LoraRows(pairs) if pairs else None

    # ---- vLLM's worker LoRA manager interface ----

    def create_lora_manager(self, model, vllm_config=None):
        return model

    def set_active_adapters(self, requests, mapping) -> None:
        """This step's adapters into slots (loaded first where new), then each slot's token mask from vLLM's
        mapping (`index_mapping`: each scheduled token's lora_int_id, 0 for none)."""
        wanted = {r.lora_int_id: r for r in requests if r}
        if len(wanted) > len(self.slot_ids):
            raise RuntimeError(f"{len(wanted)} adapters in one step, more than max_loras={len(self.slot_ids)}")
        self.step_ids = set(wanted)  # not evicted while this step's adapters are loaded
        try:
            for request in wanted.values():
                self.add_adapter(request)
        finally:
            self.step_ids = set()
        for lora_id in wanted:
            if lora_id not in self.slot_ids:
                free = next(i for i, held in enumerate(self.slot_ids) if held not in wanted)
                self._fill(free, lora_id)
            if lora_id in self.loaded:
                self.loaded.move_to_end(lora_id)
        if mapping is not None:
            self._set_masks(np.asarray(mapping.index_mapping, dtype=np.int64))

    def add_adapter(self, request) -> bool:
        """Reads `request`'s PEFT checkpoint (again where `load_inplace`), checks it and keeps it; False where
        it is loaded already. A refused adapter leaves every loaded one as it was."""
        lora_id = request.lora_int_id
        if (lora_id in self.loaded or lora_id in self.dummies) and not getattr(request, "load_inplace", False):
            return False
        adapter = self._read(request)
        self.loaded[lora_id] = (request.lora_name, adapter)
        self.loaded.move_to_end(lora_id)
        self.dummies.discard(lora_id)
        if lora_id in self.slot_ids:  # reloaded in place while it holds a slot
            self._fill(self.slot_ids.index(lora_id), lora_id)
        self._evict(keep=lora_id)
        return True

    def remove_adapter(self, lora_id: int) -> bool:
        if lora_id not in self.loaded and lora_id not in self.dummies:
            return False
        self.loaded.pop(lora_id, None)
        self.dummies.discard(lora_id)
        self.pinned.discard(lora_id)
        if lora_id in self.slot_ids:
            self._empty(self.slot_ids.index(lora_id))
        return True

    def remove_all_adapters(self) -> None:
        for lora_id in list(self.loaded) + list(self.dummies):
            self.remove_adapter(lora_id)

    def list_adapters(self) -> set[int]:
        return set(self.loaded) | self.dummies

    def pin_adapter(self, lora_id: int) -> bool:
        if lora_id not in self.loaded:
            raise ValueError(f"LoRA {lora_id} is not loaded, so it cannot be pinned")
        self.pinned.add(lora_id)
        return True

    def add_dummy_lora(self, request, rank: int) -> bool:
        if request.lora_int_id in self.list_adapters():
            return False
        self.dummies.add(request.lora_int_id)
        return True

    def get_dummy_lora_warmup_rank(self, default_rank: int) -> int:
        return default_rank

    def dummy_lora_cache(self):
        return contextlib.nullcontext()

    def supports_tower_connector_lora(self) -> bool:
        return False

    # ---- slots ----

    def _read(self, request) -> LoraAdapter:
        path = os.path.abspath(os.path.expanduser(request.lora_path))
        if not os.path.isdir(path):
            raise _not_found(request.lora_name, request.lora_path)
        adapter = load_adapter(path)
        check_adapter(adapter, self.shapes, max_rank=self.max_rank, digest=False)
        if self.graphs and not same_settings(adapter.settings(), self.hint):
            raise AdapterError(f"LoRA {request.lora_name!r} has settings {adapter.settings()}, but this engine's "
                               f"CUDA graphs were captured for {self.hint} (lora_hint); load adapters of those "
                               "settings, or build the engine with enforce_eager=True")
        return adapter

    def _fill(self, slot: int, lora_id: int) -> None:
        self.slot_ids[slot] = lora_id
        if lora_id not in self.loaded:  # a warm-up adapter
            self._empty(slot, keep_id=True)
            return
        name, adapter = self.loaded[lora_id]
        fresh = adapter.weights(name, self.device)
        if self.fixed and same_settings(adapter.settings(), self.hint):
            copy_weights(self.fixed[slot], fresh)
            self.slot_weights[slot] = self.fixed[slot]
        else:  # an eager engine: an adapter of other settings runs from its own tensors
            self.slot_weights[slot] = fresh

    def _empty(self, slot: int, keep_id: bool = False) -> None:
        """No adapter in `slot`: its mask is cleared at the next step; with graphs its tensors stay allocated."""
        if not keep_id:
            self.slot_ids[slot] = None
        if not self.graphs:
            self.slot_weights[slot] = None

    def _set_masks(self, token_ids: np.ndarray) -> None:
        n = len(token_ids)
        if n > self.masks.shape[1]:
            raise ValueError(f"{n} tokens in a step exceed the LoRA token masks' {self.masks.shape[1]}")
        # a fresh host tensor each step, pinned on a GPU (as vLLM's own LoRA mapping is): a copy from pageable
        # memory goes through the driver's staging buffer, which can hold the host until an earlier copy is
        # done. PyTorch's pinned-memory cache does not hand the buffer out again before this copy has run.
        host = torch.zeros(tuple(self.masks.shape), dtype=torch.bool, pin_memory=self.device.type == "cuda")
        view = host.numpy()
        for slot, lora_id in enumerate(self.slot_ids):
            if lora_id is not None and lora_id in self.loaded:
                view[slot, :n] = token_ids == lora_id
        self.masks.copy_(host, non_blocking=True)

    def _evict(self, keep: int) -> None:
        """Least recently used adapters out, beyond max_cpu_loras: never `keep` (just loaded), one in a slot,
        one this step asks for, or a pinned one."""
        for lora_id in list(self.loaded):
            if len(self.loaded) <= self.capacity:
                return
            if lora_id != keep and lora_id not in self.slot_ids and lora_id not in self.step_ids \
                    and lora_id not in self.pinned:
                del self.loaded[lora_id]


def _not_found(name: str, path: str) -> Exception:
    """vLLM's own error for an adapter directory that does not exist (the server answers it with a 404)."""
    try:
        from vllm.exceptions import LoRAAdapterNotFoundError
        return LoRAAdapterNotFoundError(name, path)
    except ImportError:
        return FileNotFoundError(f"LoRA adapter {name!r}: no directory at {path}")
