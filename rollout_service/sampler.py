"""The one sampler of the service: the seeded Gumbel rule (kernels.sample) and the reported log-prob
(kernels.logprobs) for rows with per-row parameters. The verifier, the native fast path and the vLLM
logits processor all sample here."""
from __future__ import annotations

import torch

from kernels import sample
from kernels.logprobs import token_logprobs


def sample_tokens(logits: torch.Tensor, temperatures, top_ks, top_ps, seeds, positions) -> torch.Tensor:
    """kernels.sample with per-row values given as host lists (their argument checks then run without
    a device sync; the copies to the device are asynchronous)."""
    return sample(logits, torch.tensor(temperatures, dtype=torch.float32), torch.tensor(top_ks),
                  torch.tensor(top_ps, dtype=torch.float32), torch.tensor(seeds, dtype=torch.int64),
                  torch.tensor(positions, dtype=torch.int64))


def sample_rows(logits: torch.Tensor, params_rows, positions: list[int]) -> torch.Tensor:
    """sample_tokens for rows with per-row SamplingParams."""
    return sample_tokens(logits, [p.temperature for p in params_rows], [p.top_k for p in params_rows],
                         [p.top_p for p in params_rows], [p.effective_seed for p in params_rows], positions)


def token_logprobs_at(logits: torch.Tensor, params_rows, tokens: torch.Tensor, log_softmax) -> torch.Tensor:
    """kernels.logprobs.token_logprobs for rows with per-row SamplingParams."""
    return token_logprobs(logits, [p.temperature for p in params_rows], tokens, log_softmax)
