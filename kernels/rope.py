"""Rotary position tables computed from a model's config alone, one fixed way on every machine.

A module's `inv_freq` buffer is not part of the model's numbers: its dtype depends on how the model
object was made (float32 after `from_pretrained(dtype=bf16)`, bf16 after `.to(bf16)`), so a table read
from it differs between the rollout engine and a trainer. Here every value is computed with Python's
float64 math (correctly rounded IEEE operations and libm, no vectorised torch kernels): inv_freq is
rounded to float32 once; angles are float64 `position * inv_freq`; cos/sin are rounded to float32 and
multiplied (in float32) by the float32 attention scaling. The formulas are transformers'
(modeling_rope_utils) for the rope types that Llama / Qwen2 / Qwen3 use.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def to_float32(x: float) -> float:
    """x rounded to the nearest float32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class RopeSpec:
    """A config's rotary settings, read from either transformers convention."""
    rope_type: str
    theta: float
    head_dim: int
    rotary_dim: int  # head_dim * partial_rotary_factor
    max_position_embeddings: int
    original_max_position_embeddings: int
    params: tuple[tuple[str, object], ...]  # the rope type's own settings (factor, beta_fast, ...)

    @classmethod
    def from_config(cls, config) -> RopeSpec:
        # transformers 5.x: config.rope_parameters holds everything, rope_theta included;
        # 4.x: config.rope_theta next to config.rope_scaling (None for plain RoPE; legacy key "type").
        params = getattr(config, "rope_parameters", None)
        if not isinstance(params, dict) or not params:
            params = getattr(config, "rope_scaling", None) or {}
        params = dict(params)
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type rope parameters are not supported (Llama / Qwen2 / Qwen3 use one)")
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}")
        missing = [k for k in _REQUIRED.get(rope_type, ()) if params.get(k) is None]
        if missing:
            raise ValueError(f"rope_type {rope_type!r} needs {', '.join(missing)} in the config's rope parameters")
        theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or getattr(config, "default_theta", 1e4)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        partial = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        max_pos = config.max_position_embeddings
        original = (params.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", None) or max_pos)
        own = tuple(sorted((k, v) for k, v in params.items()
                           if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor",
                                        "original_max_position_embeddings")))
        return cls(rope_type, float(theta), int(head_dim), int(head_dim * partial), int(max_pos), int(original), own)

    def param(self, name: str, default=None):
        value = dict(self.params).get(name)
        return default if value is None else value

    def default_inv_freq(self) -> list[float]:
        """float64 1 / theta^(i / dim), i = 0, 2, ..., dim - 2 (not yet rounded)."""
        return [1.0 / math.pow(self.theta, i / self.rotary_dim) for i in range(0, self.rotary_dim, 2)]

    def inv_freq(self, position: int = 0) -> list[float]:
        """float32-rounded inverse frequencies for the table row of `position`."""
        if self.rope_type == "dynamic" and position >= self.max_position_embeddings:
            return [to_float32(f) for f in self._dynamic_ntk(seq_len=position + 1)]
        return [to_float32(f) for f in self._static()]

    def attention_scaling(self) -> float:
        """float32 factor on cos/sin: yarn's attention_factor, 1.0 for every other type."""
        if self.rope_type != "yarn":
            return 1.0
        factor = self._yarn_factor()
        attention_factor = self.param("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = self.param("mscale"), self.param("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return to_float32(float(attention_factor))

    # ---- the rope types (float64, transformers' formulas) ----------------------------------------
    def _static(self) -> list[float]:
        base = self.default_inv_freq()
        if self.rope_type in ("default", "dynamic"):  # dynamic: below max_position_embeddings it is plain RoPE
            return base
        if self.rope_type == "linear":
            return [f / self.param("factor") for f in base]
        if self.rope_type == "llama3":
            return self._llama3(base)
        return self._yarn()

    def _dynamic_ntk(self, seq_len: int) -> list[float]:
        # Transformers recomputes inv_freq from the longest sequence in the batch, which makes a row depend
        # on its batch. Canonically a table row depends on its position only: position p >= max_position_embeddings
        # uses the dynamic-NTK frequencies of a sequence of length p + 1 (transformers' formula, seq_len = p + 1).
        dim, factor, max_pos = self.rotary_dim, self.param("factor"), self.max_position_embeddings
        seq_len = max(seq_len, max_pos)
        base = self.theta * math.pow(factor * seq_len / max_pos - (factor - 1), dim / (dim - 2))
        return [1.0 / math.pow(base, i / dim) for i in range(0, dim, 2)]

    def _llama3(self, base: list[float]) -> list[float]:
        factor, low, high = self.param("factor"), self.param("low_freq_factor"), self.param("high_freq_factor")
        old_context = self.original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
        out = []
        for f in base:
            wavelen = 2 * math.pi / f
            if wavelen < high_freq_wavelen:
                out.append(f)
            elif wavelen > low_freq_wavelen:
                out.append(f / factor)
            else:
                smooth = (old_context / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return out

    def _yarn_factor(self) -> float:
        factor = self.param("factor")
        if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
            return self.max_position_embeddings / self.original_max_position_embeddings
        return factor

    def _yarn(self) -> list[float]:
        dim, base, factor = self.rotary_dim, self.theta, self._yarn_factor()
        beta_fast, beta_slow = self.param("beta_fast") or 32, self.param("beta_slow") or 1
        original = self.original_max_position_embeddings

        def correction_dim(num_rotations):
            return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.param("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        out = []
        for j, i in enumerate(range(0, dim, 2)):
            pos_freq = math.pow(base, i / dim)
            interpolated = min(max((j - low) / (high - low), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
            out.append(1.0 / (factor * pos_freq) * interpolated + 1.0 / pos_freq * (1.0 - interpolated))
        return out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RopeTable:
    """float32 cos/sin [positions, rotary_dim / 2] per absolute position, grown lazily in chunks."""

    def __init__(self, spec: RopeSpec, chunk: int = 1024):
        self.spec = spec
        self.chunk = chunk
        self.scaling = spec.attention_scaling()
        self._static_inv_freq = spec.inv_freq(0)
        self.cos = torch.empty(0, spec.rotary_dim // 2)
        self.sin = torch.empty(0, spec.rotary_dim // 2)
        self.bounded = False  # see bound()

    @classmethod
    def from_config(cls, config, chunk: int = 1024) -> RopeTable:
        return cls(RopeSpec.from_config(config), chunk)

    def _inv_freq_at(self, position: int) -> list[float]:
        if self.spec.rope_type == "dynamic" and position >= self.spec.max_position_embeddings:
            return self.spec.inv_freq(position)
        return self._static_inv_freq

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [start, stop) on the CPU, computed from scratch."""
        angles = [[p * f for f in self._inv_freq_at(p)] for p in range(start, stop)]
        cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64).float()
        sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64).float()
        cos, sin = cos.reshape(-1, len(self._static_inv_freq)), sin.reshape(-1, len(self._static_inv_freq))
        if self.scaling != 1.0:
            scaling = torch.tensor(self.scaling, dtype=torch.float32)
            cos, sin = cos * scaling, sin * scaling
        return cos, sin

    def _grow(self, n: int) -> None:
        start = self.cos.shape[0]
        stop = -(-n // self.chunk) * self.chunk
        cos, sin = self.rows(start, stop)
        dev = self.cos.device
        self.cos = torch.cat([self.cos, cos.to(dev)])
        self.sin = torch.cat([self.sin, sin.to(dev)])

    def reserve(self, num_positions: int, device: torch.device | str | None = None) -> None:
        """Precompute positions [0, num_positions) (on `device`): CUDA-graph captures skip the growth check."""
        if num_positions > self.cos.shape[0]:
            self._grow(num_positions)
        if device is not None:
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def bound(self, num_positions: int, device: torch.device | str | None = None) -> None:
        """reserve(), for a caller whose positions never reach num_positions (vLLM bounds them by
        max_model_len): lookups then skip the growth check, a host sync that would hold the host until
        the GPU has drained (under vLLM's asynchronous scheduling, every eager step). A position past
        the bound is then an indexing error."""
        self.reserve(num_positions, device)
        self.bounded = True

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        if not (capturing or self.bounded):  # the check needs a host sync; captures rely on reserve()
            need = int(positions.max().item()) + 1 if positions.numel() else 0
            if need > self.cos.shape[0]:
                self._grow(need)
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        idx = positions.clamp_min(0)
        return self.cos[idx], self.sin[idx]
