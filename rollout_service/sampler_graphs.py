"""The sampling rule and the sampled token's log-prob, replayed from CUDA graphs.

Launched from Python, a step's sampling is about a dozen small launches (the Gumbel pass and its
per-row reduction, the two log-softmax passes, the temperature mapping, the parameter copies): about
0.6 ms of host time per step, which vLLM's asynchronous scheduling cannot hide once the host is what
limits a decode step. Replayed, it is one parameter copy, one logits copy and one graph launch.

Rows are padded to a power-of-two bucket. The rule and the log-prob treat every row on its own, so a
padding row (stale values) cannot change a real row's bits, and a replay runs the eager kernels on
the same inputs: the same bits. Rows with top-k or top-p run eagerly (their sort over the vocabulary
would pin large graph-private buffers).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.logprobs import token_logprobs
from kernels.sampling import sample_checked

from .sampler import RowParams
from .staging import pinned


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class SamplerGraphs:
    """(tokens, log-probs) of the rule for float32 logits rows [n <= max_rows, vocab] on `device`
    whose RowParams need no top-k/top-p mask; a graph is captured on a bucket's first use."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device | str):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"sampler graphs need a CUDA device, got {device}")
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.max_rows, self.vocab = _bucket(max_rows), vocab
        self.logits = torch.zeros(self.max_rows, vocab, dtype=torch.float32, device=self.device)
        # per bucket b: seed int64 [b] | position int64 [b] | temperature float32 [b], one copy in
        self.params = torch.zeros(20 * self.max_rows, dtype=torch.uint8, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}

    def covers(self, logits: torch.Tensor, rows: RowParams) -> bool:
        return (logits.device == self.device and logits.dtype == torch.float32 and logits.dim() == 2
                and logits.shape[1] == self.vocab and 0 < len(rows) <= self.max_rows and not rows.needs_mask)

    def __call__(self, logits: torch.Tensor, rows: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(rows)
        b = _bucket(n)
        host = [np.zeros(b, np.int64), np.zeros(b, np.int64), np.zeros(b, np.float32)]
        for pad, values in zip(host, (rows.seed, rows.position, rows.temperature)):
            pad[:n] = values
        self.params[: 20 * b].copy_(pinned([a.view(np.uint8) for a in host]), non_blocking=True)
        self.logits[:n].copy_(logits)
        entry = self.graphs.get(b)
        if entry is None:  # first use: the eager run is this step's answer and compiles the kernels
            tokens, logprobs = self._rule(b)
            self.graphs[b] = self._capture(b)
        else:
            entry[0].replay()
            tokens, logprobs = entry[1]
        return tokens[:n].clone(), logprobs[:n].clone()  # the next replay overwrites the graph's outputs

    def _rule(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        seed, position = self.params[: 16 * b].view(torch.int64).split(b)
        temperature = self.params[16 * b: 20 * b].view(torch.float32)
        logits = self.logits[:b]
        off = torch.zeros(b, dtype=torch.int64, device=self.device)  # top-k/top-p unused without a mask
        tokens = sample_checked(logits, temperature, off, off, seed, position, needs_mask=False)
        return tokens, token_logprobs(logits, temperature, tokens)

    def _capture(self, b: int):
        graph = torch.cuda.CUDAGraph()
        # thread_local: vLLM's output thread may use CUDA meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = self._rule(b)
        return graph, outputs
