"""Runs one forward over a padded batch of sequence chunks against the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.forward import OpSet, PagedKV, compute_logits, forward_hidden
from kernels.lora import LoraRows, LoraWeights
from rollout_service.engine.kv_cache import KVCache


@dataclass
class Chunk:
    token_ids: list[int]  # tokens fed this pass (their KV is written); see forward's token_ids
    start_pos: int  # absolute position of token_ids[0]
    block_ids: list[int]
    num_logits: int  # logits wanted for the last num_logits tokens
    adapter: str | None = None  # the LoRA adapter its request runs with (the runner's `adapters`)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, ops: OpSet, device: torch.device,
                 adapters: dict[str, LoraWeights] | None = None):
        self.model, self.cache, self.ops, self.device = model, cache, ops, torch.device(device)
        self.adapters = {} if adapters is None else adapters  # the engine's loaded LoRA adapters, by name

    def lora_rows(self, chunks: list[Chunk], t_max: int) -> LoraRows | None:
        """Each named adapter with the rows [B, T] of the chunks that run with it; None when none does."""
        names = {c.adapter for c in chunks} - {None}
        if not names:
            return None
        adapters = []
        for name in sorted(names):
            rows = torch.tensor([c.adapter == name for c in chunks])
            mask = rows.unsqueeze(1).expand(len(chunks), t_max).to(self.device, non_blocking=True)
            adapters.append((self.adapters[name], mask))
        return LoraRows(tuple(adapters))

    def host_inputs(self, chunks: list[Chunk], bsz: int, t_max: int, width: int):
        """CPU ids, positions, block table and slot mapping for chunks padded to [bsz, t_max]
        (padding: position -1, K/V to the cache's scratch slot)."""
        ids = np.zeros((bsz, t_max), dtype=np.int64)
        pos = np.full((bsz, t_max), -1, dtype=np.int64)
        table = np.zeros((bsz, width), dtype=np.int32)
        for i, c in enumerate(chunks):  # numpy row writes: cheap per chunk (this runs every decode step)
            n = len(c.token_ids)
            ids[i, :n] = c.token_ids
            pos[i, :n] = np.arange(c.start_pos, c.start_pos + n)
            table[i, :len(c.block_ids)] = c.block_ids
        bs = self.cache.block_size
        safe = np.maximum(pos, 0)
        slots = np.take_along_axis(table, safe // bs, axis=1).astype(np.int64) * bs + safe % bs
        slots = np.where(pos >= 0, slots, self.cache.scratch_slot)
        return tuple(torch.from_numpy(a) for a in (ids, pos, table, slots))

    @staticmethod
    def _feed(ids: torch.Tensor, token_ids: torch.Tensor | None) -> None:
        if token_ids is not None:
            if ids.shape[1] != 1 or token_ids.numel() > ids.shape[0]:
                raise ValueError("device token_ids are for one-token chunks, one id per chunk")
            ids[:token_ids.numel(), 0].copy_(token_ids)

    @staticmethod
    def logit_rows(chunks: list[Chunk], t_max: int) -> torch.Tensor:
        """Flat row index of every wanted logit: the last num_logits tokens of each chunk."""
        return torch.from_numpy(np.concatenate([np.arange(len(c.token_ids) - c.num_logits, len(c.token_ids)) + i * t_max
                                                for i, c in enumerate(chunks)]))

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], token_ids: torch.Tensor | None = None,
                routing: list | None = None) -> list[torch.Tensor]:
        """float32 logits [num_logits, V] for each chunk.

        token_ids: optional device tensor [len(chunks)] of one-token chunks' ids, used instead of
        the chunks' own (placeholders then): decode steps feed sampled tokens without a host sync.
        routing: a list that receives, per chunk, the device int tensor [num_logits, moe_layers, k] of
        expert ids at the logit rows (the routing that produced each logit row; moe_layers is 0 for a
        dense model).
        """
        bsz, t_max = len(chunks), max(len(c.token_ids) for c in chunks)
        width = max(len(c.block_ids) for c in chunks)
        inputs = self.host_inputs(chunks, bsz, t_max, width)
        ids, pos, table, slots = (t.to(self.device, non_blocking=True) for t in inputs)
        self._feed(ids, token_ids)
        kv = PagedKV(self.cache.k, self.cache.v, table, slots)
        layers = None if routing is None else []
        hidden = forward_hidden(self.model, ids, pos, ops=self.ops, kv=kv, routing=layers,
                                lora=self.lora_rows(chunks, t_max))
        if routing is not None:  # per layer [B, T, k] -> [B * T, layers, k]
            experts = (torch.stack(layers, dim=2) if layers else ids.new_zeros(bsz, t_max, 0, 0)).flatten(0, 1)
        sizes = [c.num_logits for c in chunks]
        if not sum(sizes):  # a prefill chunk that ends mid-prompt: KV only
            if routing is not None:
                routing += [experts[:0]] * len(chunks)
            return [hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32) for _ in chunks]
        rows = self.logit_rows(chunks, t_max).to(self.device, non_blocking=True)
        if routing is not None:
            routing += experts[rows].split(sizes)  # gathered like the logits
        logits = compute_logits(self.model, hidden.reshape(bsz * t_max, -1)[rows], self.ops)
        return list(logits.split(sizes))
