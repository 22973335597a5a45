"""The one sampler of the service: the seeded Gumbel rule (kernels.sample) and the reported log-prob
(kernels.logprobs) for rows with per-row parameters. The verifier, the native fast path and the vLLM
carriers all sample here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.logprobs import token_logprobs
from kernels.sampling import any_row_masked, check_row_values, sample_checked
from rollout_service.engine.staging import stage


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as host arrays, checked when built, so that sampling with them
    needs no device sync: temperature (0 = greedy), top_k (<= 0 = off), top_p (1 = off), seed and
    the absolute position of the token being sampled."""
    temperature: np.ndarray  # float32 [N]
    top_k: np.ndarray  # int64 [N]
    top_p: np.ndarray  # float32 [N]
    seed: np.ndarray  # int64 [N]
    position: np.ndarray  # int64 [N]

    def __post_init__(self):
        n = len(self.temperature)
        if any(len(a) != n for a in (self.top_k, self.top_p, self.seed, self.position)):
            raise ValueError("RowParams: every parameter needs one value per row")
        check_row_values(self.temperature, self.top_p, self.position)

    @classmethod
    def checked_already(cls, temperature, top_k, top_p, seed, position) -> "RowParams":
        """From arrays of the right dtypes whose values were checked before (the vLLM plugin checks each
        request's once, when vLLM adds it): no per-step check, which is most of a step's host time here."""
        rows = object.__new__(cls)
        for name, value in zip(("temperature", "top_k", "top_p", "seed", "position"),
                               (temperature, top_k, top_p, seed, position)):
            object.__setattr__(rows, name, value)
        return rows

    @classmethod
    def from_values(cls, temperature, top_k, top_p, seed, position) -> "RowParams":
        """From per-row sequences (lists or arrays)."""
        return cls(np.asarray(temperature, dtype=np.float32), np.asarray(top_k, dtype=np.int64),
                   np.asarray(top_p, dtype=np.float32), np.asarray(seed, dtype=np.int64),
                   np.asarray(position, dtype=np.int64))

    @classmethod
    def from_sampling_params(cls, params_rows, positions) -> "RowParams":
        """From per-row SamplingParams and the positions of the tokens they sample."""
        return cls.from_values([p.temperature for p in params_rows], [p.top_k for p in params_rows],
                               [p.top_p for p in params_rows], [p.effective_seed for p in params_rows], positions)

    def __len__(self) -> int:
        return len(self.temperature)

    def with_seeds(self, seed: np.ndarray) -> "RowParams":
        return RowParams(self.temperature, self.top_k, self.top_p, np.asarray(seed, dtype=np.int64), self.position)

    @property
    def needs_mask(self) -> bool:
        return any_row_masked(self.top_k, self.top_p)

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(temperature, top_k, top_p, seed, position) tensors on `device`: two copies, no sync."""
        temperature, top_p = stage([self.temperature, self.top_p], device)
        top_k, seed, position = stage([self.top_k, self.seed, self.position], device)
        return temperature, top_k, top_p, seed, position


def _sample_staged(logits: torch.Tensor, rows: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, the rows' temperatures on the device): the params staged once, no device sync."""
    temperature, top_k, top_p, seed, position = rows.on(logits.device)
    return sample_checked(logits, temperature, top_k, top_p, seed, position, rows.needs_mask), temperature


def sample_tokens(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """kernels.sample over float32 logits rows with per-row `rows` (no device sync)."""
    return _sample_staged(logits, rows)[0]


def sample_with_logprobs(logits: torch.Tensor, rows: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample_tokens, their kernels.logprobs.token_logprobs at each row's temperature), the params
    staged to the device once for both (no device sync)."""
    tokens, temperature = _sample_staged(logits, rows)
    return tokens, token_logprobs(logits, temperature, tokens)


def sample_rows(logits: torch.Tensor, params_rows, positions: list[int]) -> torch.Tensor:
    """sample_tokens for rows with per-row SamplingParams."""
    return sample_tokens(logits, RowParams.from_sampling_params(params_rows, positions))


def token_logprobs_at(logits: torch.Tensor, params_rows, tokens: torch.Tensor, log_softmax) -> torch.Tensor:
    """kernels.logprobs.token_logprobs for rows with per-row SamplingParams."""
    return token_logprobs(logits, [p.temperature for p in params_rows], tokens, log_softmax)
