"""The sampling rule and the sampled token's log-prob, replayed from CUDA graphs.

Launched from Python, a step's sampling is about a dozen small launches (the Gumbel pass and its
per-row reduction, the two log-softmax passes, the temperature mapping, the parameter copies): host
time on every step, which vLLM's asynchronous scheduling cannot hide once the host is what limits a
decode step (bench/results/2026-11-25). Replayed, it is one parameter copy, one logits copy and one
graph launch.

Rows are padded to a power-of-two bucket. The rule and the log-prob treat every row on its own, so a
padding row (stale values) cannot change a real row's bits, and a replay runs the eager kernels on
the same inputs: the same bits. Rows with top-k or top-p run eagerly (their sort over the vocabulary
would pin large graph-private buffers).

The logits can come from a graph too (`compute_logits`): the lm_head product of a step's hidden rows,
replayed per bucket into the buffer the rule's graphs read, so a decode step's head and sampling cost
two copies and two replays of host time (an eager product is a Triton launch from Python). The
canonical product gives every row the same bits at any row count, so the padded bucket changes no row.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.logprobs import token_logprobs
from kernels.sampling import sample_checked
from rollout_service.engine.sampler import RowParams


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


_STAGING_SLOTS = 4  # pinned parameter buffers used in turn (a slot is rewritten once its last copy has run)


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
        self._staging = [torch.zeros(20 * self.max_rows, dtype=torch.uint8).pin_memory()
                         for _ in range(_STAGING_SLOTS)]
        self._staging_views = [t.numpy() for t in self._staging]
        self._staged = [torch.cuda.Event() for _ in range(_STAGING_SLOTS)]
        self._turn = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.hidden: torch.Tensor | None = None  # compute_logits' input rows, made on first use
        self.head_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # one memory pool for every graph here (not one per bucket: a head graph's temporary logits are
        # [bucket, vocab] float32). A capture may put its outputs where an earlier one kept temporaries,
        # which that one's replay then overwrites: harmless, as every replay's outputs are copied out
        # (or consumed) before the next replay on the same stream.
        self.pool = torch.cuda.graph_pool_handle()

    def covers(self, logits: torch.Tensor, rows: RowParams) -> bool:
        return (logits.device == self.device and logits.dtype == torch.float32 and logits.dim() == 2
                and logits.shape[1] == self.vocab and 0 < len(rows) <= self.max_rows and not rows.needs_mask)

    def __call__(self, logits: torch.Tensor, rows: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(rows)
        b = _bucket(n)
        self._stage(rows, n, b)
        if not (self.holds(logits) and logits.shape[0] == n):  # compute_logits wrote them in place
            self.logits[:n].copy_(logits)
        entry = self.graphs.get(b)
        if entry is None:  # first use: the eager run is this step's answer and compiles the kernels
            tokens, logprobs = self._rule(b)
            self.graphs[b] = self._capture(lambda: self._rule(b))
        else:
            entry[0].replay()
            tokens, logprobs = entry[1]
        return tokens[:n].clone(), logprobs[:n].clone()  # the next replay overwrites the graph's outputs

    def holds(self, logits: torch.Tensor) -> bool:
        """Whether `logits` are this buffer's first rows (compute_logits' answer)."""
        return logits.data_ptr() == self.logits.data_ptr() and logits.shape[1:] == self.logits.shape[1:]

    def compute_logits(self, hidden: torch.Tensor, head) -> torch.Tensor | None:
        """head(hidden rows [n, H]) -> float32 logits [n, vocab], replayed from a graph per bucket into
        this buffer's first n rows (read by the rule's graphs without a copy, overwritten by the next
        call); None where a graph cannot serve: more rows than max_rows, another device, or during
        another graph's capture. `head` must read the same weight tensors on every call (an in-place
        weight reload keeps them)."""
        n = hidden.shape[0]
        if (hidden.dim() != 2 or not 0 < n <= self.max_rows or hidden.device != self.device
                or torch.cuda.is_current_stream_capturing()):
            return None
        if self.hidden is None or self.hidden.shape[1:] != hidden.shape[1:] or self.hidden.dtype != hidden.dtype:
            self.hidden = torch.zeros(self.max_rows, *hidden.shape[1:], dtype=hidden.dtype, device=self.device)
            self.head_graphs.clear()
        b = _bucket(n)
        self.hidden[:n].copy_(hidden)
        graph = self.head_graphs.get(b)
        if graph is None:  # first use: eager (compiles the kernels), then captured
            self._head(head, b)
            self.head_graphs[b] = self._capture(lambda: self._head(head, b))[0]
        else:
            graph.replay()
        return self.logits[:n]

    def _head(self, head, b: int) -> None:
        logits = head(self.hidden[:b])
        if logits.shape != (b, self.vocab) or logits.dtype != torch.float32:
            raise ValueError(f"head gave {tuple(logits.shape)} {logits.dtype} logits; sampler graphs hold "
                             f"float32 [rows, {self.vocab}]")
        self.logits[:b].copy_(logits)

    def _stage(self, rows: RowParams, n: int, b: int) -> None:
        """This call's seeds, positions and temperatures (zeros past row n) into self.params: written into a
        pinned buffer, copied without a device sync."""
        turn = self._turn
        self._turn = (turn + 1) % _STAGING_SLOTS
        self._staged[turn].synchronize()  # that buffer's last copy has run (long ago, in practice)
        host = self._staging_views[turn]
        for start, dtype, values in ((0, np.int64, rows.seed), (8 * b, np.int64, rows.position),
                                     (16 * b, np.float32, rows.temperature)):
            column = host[start: start + b * np.dtype(dtype).itemsize].view(dtype)
            column[:n] = values
            column[n:] = 0
        self.params[: 20 * b].copy_(self._staging[turn][: 20 * b], non_blocking=True)
        self._staged[turn].record()

    def _rule(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        seed, position = self.params[: 16 * b].view(torch.int64).split(b)
        temperature = self.params[16 * b: 20 * b].view(torch.float32)
        logits = self.logits[:b]
        off = torch.zeros(b, dtype=torch.int64, device=self.device)  # top-k/top-p unused without a mask
        tokens = sample_checked(logits, temperature, off, off, seed, position, needs_mask=False)
        return tokens, token_logprobs(logits, temperature, tokens)

    def _capture(self, run):
        graph = torch.cuda.CUDAGraph()
        # thread_local: vLLM's output thread may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = run()
        return graph, outputs
