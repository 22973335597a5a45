"""A LoRA adapter inside the canonical vLLM model, applied to every token (one policy adapter: TRL's PEFT
training, loaded through the worker's zerokl_load_adapter; kernels/lora.py's rule, so its log-probs are the
trainer's bit for bit), and the helpers it shares with per-request adapters (plugin/request_adapters.py:
vLLM's enable_lora and LoRARequest, and why vLLM's own LoRA manager cannot drive the canonical layers).

CUDA graphs: a graph replays what was captured, so the adapter's tensors must exist, at their final
shapes, when vLLM captures: `lora_hint` (in hf_overrides) sizes a zero adapter at load time, and every
load copies into those tensors in place. Without a hint, an adapter can load only into an eager engine.
A hinted adapter's A matrices are held as extra rows of the base weights (kernels.forward.fuse_projections),
so each shrink is a part of its base product: no launch of its own, the same bits.
"""
from __future__ import annotations

import torch

from kernels.forward import fuse_projections
from kernels.lora import LoraRows, LoraWeights
from rollout_service.lora import PROJECTIONS, LoraAdapter, check_adapter, projection_shapes

HINT_KEY = "zerokl_lora"  # hf_overrides key: the adapter's settings, so its tensors exist before graphs are captured


def lora_hint(r: int, alpha: float, target_modules, use_rslora: bool = False) -> dict:
    """hf_overrides entries that size adapters at load time (LoraAdapter.settings' fields)."""
    return {HINT_KEY: {"r": int(r), "alpha": float(alpha), "target_modules": sorted(target_modules),
                       "use_rslora": bool(use_rslora)}}


def zero_adapter(hf: torch.nn.Module, settings: dict) -> LoraAdapter:
    """An adapter of these settings whose A and B are zero: the tensors a CUDA graph captures before any
    real adapter is copied into them."""
    tensors = {}
    for (layer, name), (out, inp) in projection_shapes(hf).items():
        if name in settings["target_modules"]:
            block = next(b for b, names in PROJECTIONS.items() if name in names)
            key = f"model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.zeros(settings["r"], inp, dtype=torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = torch.zeros(out, settings["r"], dtype=torch.bfloat16)
    return LoraAdapter.from_settings(settings, tensors)


def copy_weights(into: LoraWeights, fresh: LoraWeights) -> None:
    """`fresh`'s tensors into `into`'s, in place (captured graphs read `into`'s); the same keys and shapes."""
    for key, (a, b, _) in fresh.terms.items():
        into.terms[key][0].copy_(a)
        into.terms[key][1].copy_(b)


def same_settings(a: dict, b: dict) -> bool:
    return {**a, "target_modules": sorted(a["target_modules"])} == {**b, "target_modules": sorted(b["target_modules"])}


class PolicyAdapter:
    """The one adapter a canonical vLLM model applies to every token, or none."""

    def __init__(self, hf: torch.nn.Module, device: torch.device, graphs: bool, hint: dict | None,
                 per_request: bool = False):
        """per_request: the engine serves per-request adapters instead (enable_lora: request_adapters.py),
        whose slots then hold the base weights' extra rows."""
        self.hf, self.device, self.graphs = hf, device, graphs
        self.rows: LoraRows | None = None
        self.settings: dict | None = None
        self.hint = hint
        if hint:  # a zero adapter (B = 0: the base's numbers) at its final shapes, before any capture
            self._install(zero_adapter(hf, hint))
            if not per_request:
                fuse_projections(hf, (self.rows.adapters[0][0],))

    def load(self, adapter: LoraAdapter) -> int:
        """Check `adapter` against the model, then apply it from the next forward on; returns its bytes."""
        check_adapter(adapter, projection_shapes(self.hf), digest=False)
        if self.settings is not None and same_settings(self.settings, adapter.settings()) and self._same_tensors(adapter):
            copy_weights(self.rows.adapters[0][0], adapter.weights("policy", self.device))
            return adapter.nbytes
        if self.graphs:
            raise ValueError("this engine replays CUDA graphs captured without this adapter's tensors: build it "
                             "with rollout_service.vllm.plugin.lora_hint(r, alpha, target_modules) in hf_overrides "
                             "(the adapter's settings), or with enforce_eager=True")
        self._install(adapter)
        return adapter.nbytes

    def _same_tensors(self, adapter: LoraAdapter) -> bool:
        terms = self.rows.adapters[0][0].terms
        fresh = LoraAdapter.from_settings(adapter.settings(), adapter.tensors).weights("policy", "meta").terms
        return fresh.keys() == terms.keys() and all(fresh[k][0].shape == terms[k][0].shape for k in terms)

    def _install(self, adapter: LoraAdapter) -> None:
        weights: LoraWeights = adapter.weights("policy", self.device)
        self.rows, self.settings = LoraRows(((weights, None),)), adapter.settings()

