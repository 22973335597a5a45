"""LoRA adapters as PEFT writes them, checked against a base model, for every engine and the service.

An adapter is PEFT's own pair: a `peft.LoraConfig` (r, lora_alpha, target_modules, use_rslora) and its
tensors, named as `peft.get_peft_model_state_dict` names them (`model.layers.3.self_attn.q_proj.lora_A.weight`;
the `base_model.model.` prefix of a saved PEFT checkpoint is accepted). On disk it is a PEFT checkpoint
(`adapter_config.json` + `adapter_model.safetensors`), read and written with PEFT and safetensors.

An adapter is checked whole before any engine holds it: names, shapes against the base model, its rank,
finite values and, where the caller gives one, the digest of its tensors and of the base it was trained
on. A refused adapter changes nothing.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.lora import LoraKey, LoraWeights
from rollout_service.weights import (WeightMismatchError, check_finite, check_state_dict_types, digest_of_fingerprints,
                                     packed_rows, state_dict_digest)

PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the model's own names
_KEY = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


class AdapterError(WeightMismatchError):
    """An adapter that cannot serve on this base: a wrong base, rank, target module or digest, a bad
    config or name. A WeightMismatchError: a pool treats a refused adapter as it treats refused weights."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: its PEFT LoRA settings and its tensors (PEFT's state-dict names, no prefix)."""
    r: int
    alpha: float
    target_modules: tuple[str, ...]
    tensors: Mapping[str, torch.Tensor]
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (self.r ** 0.5 if self.use_rslora else self.r)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def digest(self) -> str:
        """The digest of the adapter's tensors (rollout_service.weights.state_dict_digest)."""
        return state_dict_digest(self.tensors)

    def settings(self) -> dict:
        """Everything but the tensors (what a bucketed push's plan carries): LoraAdapter(**settings, tensors=...)."""
        return {"r": self.r, "alpha": self.alpha, "target_modules": self.target_modules, "use_rslora": self.use_rslora}

    @classmethod
    def from_settings(cls, settings: Mapping, tensors: Mapping[str, torch.Tensor]) -> LoraAdapter:
        """An adapter from settings() (other keys ignored) and its tensors."""
        return cls(**{k: settings[k] for k in ("r", "alpha", "target_modules", "use_rslora")}, tensors=tensors)

    def peft_config(self):
        """This adapter's settings as PEFT's own LoraConfig."""
        from peft import LoraConfig
        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=sorted(self.target_modules),
                          lora_dropout=0.0, use_rslora=self.use_rslora)

    def weights(self, name: str, device: torch.device | str) -> LoraWeights:
        """The forward's view (kernels.lora.LoraWeights), bf16 on `device`."""
        pairs: dict[LoraKey, dict[str, torch.Tensor]] = {}
        for key, t in self.tensors.items():
            layer, proj, which = parse_key(key)
            pairs.setdefault((layer, proj), {})[which] = t.to(device=device, dtype=torch.bfloat16)
        return LoraWeights(name, {k: (p["A"], p["B"], self.scale) for k, p in pairs.items()})


def push_digest(adapter_digest: str, base_digest: str) -> str:
    """The digest an adapter push is checked by: its tensors' and its base's, so that an adapter trained on
    other base weights (of the same shapes) is refused too."""
    return hashlib.sha256(f"lora:{adapter_digest}|base:{base_digest}".encode()).hexdigest()[:32]


def parse_key(key: str) -> tuple[int, str, str]:
    """(layer, projection, "A" or "B") of a PEFT LoRA tensor name."""
    m = _KEY.match(key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key)
    if m is None or m.group(3) not in PROJECTIONS[m.group(2)]:
        raise AdapterError(f"{key!r} is not a LoRA tensor of a decoder projection (expected names like "
                           f"'model.layers.0.self_attn.q_proj.lora_A.weight')")
    return int(m.group(1)), m.group(3), m.group(4)


def adapter_from_peft(config, tensors: Mapping[str, torch.Tensor]) -> LoraAdapter:
    """An adapter from a peft.LoraConfig and its state dict; AdapterError for settings the canonical
    forward does not run (DoRA, per-module ranks, trained biases, extra saved modules)."""
    from peft import PeftType
    if getattr(config, "peft_type", None) != PeftType.LORA:
        raise AdapterError(f"only LoRA adapters are supported, got {getattr(config, 'peft_type', type(config).__name__)}")
    unsupported = [what for what, bad in (
        ("use_dora", config.use_dora), ("rank_pattern", bool(config.rank_pattern)),
        ("alpha_pattern", bool(config.alpha_pattern)), ("bias != 'none'", config.bias != "none"),
        ("modules_to_save", bool(config.modules_to_save)), ("fan_in_fan_out", config.fan_in_fan_out)) if bad]
    if unsupported:
        raise AdapterError(f"this LoRA config uses {', '.join(unsupported)}, which the canonical forward does not run")
    targets = config.target_modules
    if isinstance(targets, str):  # PEFT allows a regex or "all-linear"; saved configs hold the resolved set
        targets = [targets]
    check_state_dict_types(tensors)
    plain = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: t for k, t in tensors.items()}
    return LoraAdapter(int(config.r), float(config.lora_alpha), tuple(sorted(targets)), plain,
                       bool(config.use_rslora))


def adapter_from_model(model: torch.nn.Module, adapter_name: str = "default") -> LoraAdapter:
    """The adapter a PEFT-wrapped model trains (peft.inject_adapter_in_model or get_peft_model), as
    detached copies of its tensors (a PeftModel is looked through to its base model)."""
    from peft import get_peft_model_state_dict
    inner = getattr(getattr(model, "base_model", None), "model", None) if hasattr(model, "peft_type") else None
    model = inner if inner is not None else model
    configs = getattr(model, "peft_config", None)
    if not configs or adapter_name not in configs:
        raise AdapterError(f"the model carries no PEFT adapter {adapter_name!r} "
                           f"(has {sorted(configs or {}) or 'none'}); add one with peft.inject_adapter_in_model")
    tensors = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return adapter_from_peft(configs[adapter_name], {k: t.detach().clone() for k, t in tensors.items()})


def load_adapter(path: str | Path) -> LoraAdapter:
    """A PEFT checkpoint directory (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig
    from peft.utils import load_peft_weights
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise AdapterError(f"{path} is not a PEFT adapter directory: it has no adapter_config.json")
    return adapter_from_peft(LoraConfig.from_pretrained(str(path)), load_peft_weights(str(path), device="cpu"))


def save_adapter(adapter: LoraAdapter, path: str | Path) -> Path:
    """Write `adapter` as a PEFT checkpoint that PeftModel.from_pretrained loads."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    adapter.peft_config().save_pretrained(str(path))
    save_file({PEFT_PREFIX + k: t.detach().contiguous().cpu() for k, t in adapter.tensors.items()},
              str(path / "adapter_model.safetensors"))
    return path


def projection_shapes_of_spec(spec: Mapping[str, tuple]) -> dict[LoraKey, tuple[int, int]]:
    """(layer, projection) -> (out, in) from a weight spec (name -> shape, rollout_service.weights.weight_spec)."""
    shapes = {}
    for name, shape in spec.items():
        m = re.match(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$", name)
        if m and m.group(3) in PROJECTIONS[m.group(2)] and len(shape) == 2:
            shapes[(int(m.group(1)), m.group(3))] = tuple(shape)
    return shapes


def projection_shapes(model: torch.nn.Module) -> dict[LoraKey, tuple[int, int]]:
    """(layer, projection) -> (out, in) of every dense decoder projection of a base model."""
    shapes = {}
    for i, layer in enumerate(model.model.layers):
        for block, names in PROJECTIONS.items():
            for name in names:
                proj = getattr(getattr(layer, block, None), name, None)
                weight = getattr(proj, "weight", None)
                if weight is not None and weight.dim() == 2:
                    shapes[(i, name)] = tuple(weight.shape)
    return shapes


def check_adapter(adapter: LoraAdapter, shapes: Mapping[LoraKey, tuple[int, int]], *,
                  max_rank: int | None = None, expected_digest: str | None = None, digest: bool = True) -> str | None:
    """Raise AdapterError unless `adapter` fits a base with these projection shapes (check_layout), its
    values are finite and its digest is the expected one; returns its digest (None with digest=False and no
    expected_digest: the values' check alone, cheaper on the host). The values and the digest come from one
    packed pass over the tensors (weights.packed_rows)."""
    check_layout(adapter, {k: tuple(t.shape) for k, t in adapter.tensors.items()}, shapes, max_rank=max_rank)
    if not digest and expected_digest is None:
        try:
            check_finite(adapter.tensors.items())
        except WeightMismatchError as e:
            raise AdapterError(str(e)) from None
        return None
    names = list(adapter.tensors)
    rows = packed_rows(adapter.tensors[n] for n in names)
    bad = [n for n, (_, _, nonfinite) in zip(names, rows)
           if nonfinite or not torch.is_floating_point(adapter.tensors[n])]
    if bad:
        raise AdapterError(f"weights must be finite floating-point tensors: {bad[:5]}")
    got = digest_of_fingerprints((n, adapter.tensors[n].shape, (a, b)) for n, (a, b, _) in zip(names, rows))
    if expected_digest is not None and got != expected_digest:
        raise AdapterError(f"adapter digest {got} is not the expected {expected_digest}")
    return got


def check_layout(adapter: LoraAdapter, tensor_shapes: Mapping[str, tuple], shapes: Mapping[LoraKey, tuple[int, int]],
                 *, max_rank: int | None = None) -> None:
    """AdapterError unless an adapter of these settings and tensor shapes fits a base with these projection
    shapes: every target module exists, every tensor names a projection of the base with A [r, in] and
    B [out, r], each projection has both, and the rank is within `max_rank`. (The pool checks a bucketed
    adapter push so, by names and shapes alone, before any worker is touched.)"""
    if adapter.r < 1 or (max_rank is not None and adapter.r > max_rank):
        raise AdapterError(f"adapter rank {adapter.r} is outside 1..{max_rank} (the engine's max_lora_rank)")
    known = {name for names in PROJECTIONS.values() for name in names}
    present = {name for _, name in shapes}
    absent = [t for t in adapter.target_modules if t not in present]
    if absent:
        raise AdapterError(f"target modules {absent} are not projections of this base model "
                           f"(it has {sorted(present)}; supported: {sorted(known)})")
    pairs: dict[LoraKey, set[str]] = {}
    for key, shape in tensor_shapes.items():
        layer, proj, which = parse_key(key)
        if (layer, proj) not in shapes:
            raise AdapterError(f"{key!r}: the base model has no {proj} in layer {layer}")
        if proj not in adapter.target_modules:
            raise AdapterError(f"{key!r}: {proj} is not among the adapter's target_modules {list(adapter.target_modules)}")
        out, inp = shapes[(layer, proj)]
        want = (adapter.r, inp) if which == "A" else (out, adapter.r)
        if tuple(shape) != want:
            raise AdapterError(f"{key!r} has shape {tuple(shape)}, expected {want} for rank {adapter.r} on this "
                               f"base ({proj} is {out} x {inp}): a different base model or rank")
        pairs.setdefault((layer, proj), set()).add(which)
    half = sorted(k for k, v in pairs.items() if v != {"A", "B"})
    if half or not pairs:
        raise AdapterError(f"adapter tensors incomplete: {half or 'none given'} (each projection needs lora_A and lora_B)")
