"""CUDA-graph replay of the engine's small fixed-shape forwards: decode steps and verify windows.

A forward over B chunks of at most T tokens is padded to a captured (batch bucket, T) shape: padding
rows and tokens get position -1 and write their K/V to the cache's scratch slot. Canonical ops give
a row the same bits whatever the padding around it (that is what makes them canonical), so a replay
equals the eager forward bit for bit; for the fast path padding only changes which cuBLAS kernel
runs. Graphs are captured on first use of a shape; long prefill chunks run eagerly.
"""
from __future__ import annotations

import torch

from kernels.forward import PagedKV, compute_logits, forward_hidden, rope_table
from rollout_service.engine.runner import Chunk, ModelRunner

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


class GraphedModelRunner(ModelRunner):
    """A ModelRunner that replays CUDA graphs for forwards of up to max_batch[T] chunks of <= T tokens."""

    def __init__(self, model, cache, ops, device, *, max_batch: dict[int, int], max_model_len: int,
                 adapters=None):
        super().__init__(model, cache, ops, device, adapters)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.max_batch = dict(sorted(max_batch.items()))  # tokens per chunk -> largest batch
        self.width = cache.blocks_for(max_model_len)  # block-table columns: any request fits
        rope_table(model).reserve(max_model_len, self.device)  # captured forwards cannot grow it
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple, torch.Tensor]] = {}
        self._pool = None

    def shape_for(self, chunks: list[Chunk]) -> tuple[int, int] | None:
        """The captured (batch, tokens) shape these chunks are padded to, or None (run eagerly)."""
        n, t_max = len(chunks), max(len(c.token_ids) for c in chunks)
        for tokens, limit in self.max_batch.items():
            if t_max <= tokens and n <= limit:
                return next((b for b in BATCH_BUCKETS if n <= b <= limit), limit), tokens
        return None

    def capture_all(self) -> int:
        """Capture every shape now (as vLLM does at start-up) instead of on first use; returns the count."""
        for tokens, limit in self.max_batch.items():
            for bsz in sorted({b for b in BATCH_BUCKETS if b <= limit} | {limit}):
                if (bsz, tokens) not in self._graphs:
                    self._capture(bsz, tokens)
        return len(self._graphs)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], token_ids: torch.Tensor | None = None,
                routing: list | None = None) -> list[torch.Tensor]:
        shape = self.shape_for(chunks)
        # recording MoE routing runs eagerly (captured graphs have no routing outputs), and so do LoRA
        # requests (their token masks change each step): same bits
        if routing is not None or shape is None or any(c.adapter for c in chunks) or max(len(c.block_ids) for c in chunks) > self.width or (
                token_ids is not None and shape[1] != 1):
            return super().forward(chunks, token_ids, routing)
        graph, static, logits = self._graphs.get(shape) or self._capture(*shape)
        for dst, src in zip(static, self.host_inputs(chunks, *shape, self.width)):
            dst.copy_(src, non_blocking=True)
        self._feed(static[0], token_ids)
        graph.replay()
        sizes = [c.num_logits for c in chunks]
        rows = self.logit_rows(chunks, shape[1]).to(self.device, non_blocking=True)
        return list(logits[rows].split(sizes))  # a copy: the next replay overwrites `logits`

    def _run(self, ids, pos, table, slots) -> torch.Tensor:
        kv = PagedKV(self.cache.k, self.cache.v, table, slots)
        hidden = forward_hidden(self.model, ids, pos, ops=self.ops, kv=kv)
        return compute_logits(self.model, hidden.reshape(ids.numel(), -1), self.ops)

    @torch.inference_mode()
    def _capture(self, bsz: int, tokens: int):
        # all-padding inputs: warm-up and capture only write the scratch slot
        static = tuple(t.to(self.device) for t in self.host_inputs([], bsz, tokens, self.width))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles kernels, creates cuBLAS workspaces
            self._run(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._run(*static)
        self._graphs[(bsz, tokens)] = (graph, static, logits)
        return self._graphs[(bsz, tokens)]
