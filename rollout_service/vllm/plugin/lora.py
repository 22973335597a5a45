"""A LoRA adapter inside the canonical vLLM model, applied to every token (one policy adapter: TRL's PEFT
training; kernels/lora.py's rule, so its log-probs are the trainer's bit for bit).

Why not vLLM's own LoRA (enable_lora, LoRARequest): vLLM's LoRA manager adapts only its own layer classes
(vllm.lora.utils.get_supported_lora_modules keeps LinearBase and MoE modules; the canonical model's
projections are Hugging Face modules run by kernels.forward), and it computes the adapter's product with
its punica kernels, whose K order is not the canonical matmul's. So the adapter is held here and applied by
the canonical forward.

CUDA graphs: a graph replays what was captured, so the adapter's tensors must exist, at their final
shapes, when vLLM captures: `lora_hint` (in hf_overrides) sizes a zero adapter at load time, and every
load copies into those tensors in place. Without a hint, an adapter can load only into an eager engine.
"""
from __future__ import annotations

import torch

from kernels.lora import LoraRows, LoraWeights
from rollout_service.lora import PROJECTIONS, LoraAdapter, check_adapter, projection_shapes

HINT_KEY = "zerokl_lora"  # hf_overrides key: the adapter's settings, so its tensors exist before graphs are captured


def lora_hint(r: int, alpha: float, target_modules) -> dict:
    """hf_overrides entries that size a policy adapter at load time (LoraAdapter.settings' fields)."""
    return {HINT_KEY: {"r": int(r), "alpha": float(alpha), "target_modules": sorted(target_modules),
                       "use_rslora": False}}


class PolicyAdapter:
    """The one adapter a canonical vLLM model applies to every token, or none."""

    def __init__(self, hf: torch.nn.Module, device: torch.device, graphs: bool, hint: dict | None):
        self.hf, self.device, self.graphs = hf, device, graphs
        self.rows: LoraRows | None = None
        self.settings: dict | None = None
        if hint:  # a zero adapter (B = 0: the base's numbers) at its final shapes, before any capture
            shapes = projection_shapes(hf)
            tensors = {}
            for (layer, name), (out, inp) in shapes.items():
                if name in hint["target_modules"]:
                    block = next(b for b, names in PROJECTIONS.items() if name in names)
                    key = f"model.layers.{layer}.{block}.{name}"
                    tensors[f"{key}.lora_A.weight"] = torch.zeros(hint["r"], inp, dtype=torch.bfloat16)
                    tensors[f"{key}.lora_B.weight"] = torch.zeros(out, hint["r"], dtype=torch.bfloat16)
            self._install(LoraAdapter.from_settings(hint, tensors))

    def load(self, adapter: LoraAdapter) -> int:
        """Check `adapter` against the model, then apply it from the next forward on; returns its bytes."""
        check_adapter(adapter, projection_shapes(self.hf))
        if self.settings is not None and _same_settings(self.settings, adapter.settings()) and self._same_tensors(adapter):
            weights = self.rows.adapters[0][0]
            fresh = adapter.weights("policy", self.device)
            for key, (a, b, _) in fresh.terms.items():  # in place: captured graphs read these tensors
                weights.terms[key][0].copy_(a)
                weights.terms[key][1].copy_(b)
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


def _same_settings(a: dict, b: dict) -> bool:
    return {**a, "target_modules": sorted(a["target_modules"])} == {**b, "target_modules": sorted(b["target_modules"])}
