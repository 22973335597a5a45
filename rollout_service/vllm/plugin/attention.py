"""An attention backend that only manages KV: vLLM allocates the paged cache and builds the batch's
metadata; the canonical forward (kernels.forward) writes K/V and attends through `PagedKVAdapter`.

The model never calls `Attention.forward`, so the impl's forward is unreachable; the Attention
layers exist so that vLLM sizes, allocates and binds a cache per decoder layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)

import kernels as K
from rollout_service.engine.staging import stage
from rollout_service.vllm.plugin import compat


def graphed_step_tokens(compilation_config) -> int:
    """The most tokens of a step that vLLM may replay from a full CUDA graph with prefill chunks in it:
    its largest capture size where it captures mixed batches whole (cudagraph_mode FULL), else 0."""
    mode = compilation_config.cudagraph_mode
    if mode is None or mode.mixed_mode().name != "FULL":
        return 0
    return compilation_config.max_cudagraph_capture_size or 0


@dataclass
class PrefillGroups:
    """Query layout of an eager step that has prefill chunks, for kernels.attention_packed: the chunks
    (requests with more than one query token) attend as sequences of up to `longest` rows (each key
    block loaded once per tile of queries, as in training), the one-token (decode) requests as
    sequences of one row, both read from and written to vLLM's flat token batch in place. Built on the
    host from the step's query lengths; a row's numbers do not depend on the layout."""
    chunk_starts: torch.Tensor  # [P] first token of each chunk
    chunk_lens: torch.Tensor  # [P]
    chunk_requests: torch.Tensor  # [P] request row of each chunk (its block table)
    decode_starts: torch.Tensor  # [D] the token of each one-token request
    decode_lens: torch.Tensor  # [D] ones
    decode_requests: torch.Tensor  # [D]
    longest: int  # the longest chunk
    num_scheduled: int  # tokens of the step's requests; vLLM's padding tokens follow them

    @classmethod
    def from_query_starts(cls, query_start_loc_cpu: torch.Tensor, device) -> "PrefillGroups":
        starts = query_start_loc_cpu.numpy().astype(np.int64)
        lens = np.diff(starts)
        chunked, decode = np.flatnonzero(lens > 1), np.flatnonzero(lens == 1)
        arrays = dict(chunk_starts=starts[chunked], chunk_lens=lens[chunked], chunk_requests=chunked,
                      decode_starts=starts[decode], decode_lens=lens[decode], decode_requests=decode)
        fields = dict(zip(arrays, stage([a.astype(np.int64, copy=False) for a in arrays.values()], device)))
        return cls(**fields, longest=int(lens[chunked].max()), num_scheduled=int(starts[-1]))

    def attention_calls(self, block_table: torch.Tensor) -> list[tuple]:
        """(query starts, lengths, block tables, longest) of each kernels.attention_packed call: the
        one-token requests, then the chunks; none for an empty group."""
        groups = ((self.decode_starts, self.decode_lens, self.decode_requests, 1),
                  (self.chunk_starts, self.chunk_lens, self.chunk_requests, self.longest))
        return [(starts, lens, block_table[requests], longest)
                for starts, lens, requests, longest in groups if starts.numel()]


@dataclass
class ZeroKLAttentionMetadata:
    """Views of the model runner's persistent input buffers, nothing derived: everything computed
    from them happens inside the forward, so a captured CUDA graph reads this step's values."""
    num_reqs: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64 flat slot per token; -1 for padding tokens
    prefill: PrefillGroups | None = None  # eager steps with a prefill chunk (never captured)


class ZeroKLMetadataBuilder(AttentionMetadataBuilder[ZeroKLAttentionMetadata]):
    # In the [N, 1] layout the forward has no host syncs and fixed shapes per token count, so vLLM may
    # replay any step from a full CUDA graph: decode steps and, under cudagraph_mode FULL, prefill too.
    _cudagraph_support = AttentionCGSupport.ALWAYS
    reorder_batch_threshold = None  # the [N, 1] layout does not care about batch order

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.graphed_tokens = graphed_step_tokens(vllm_config.compilation_config)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ZeroKLAttentionMetadata:
        m = common_attn_metadata
        prefill = None
        # Rule: a step that a graph may replay keeps the [N, 1] layout, prefill chunks included, because
        # the packed layout's shapes come from the host and a graph would keep the captured ones. Eager
        # steps with prefill chunks attend them packed (each key block loaded once per tile of queries).
        if m.max_query_len > 1 and m.num_actual_tokens > self.graphed_tokens:
            prefill = PrefillGroups.from_query_starts(m.query_start_loc_cpu[: m.num_reqs + 1], self.device)
        return ZeroKLAttentionMetadata(int(m.num_reqs), m.query_start_loc, m.block_table_tensor,
                                       m.slot_mapping[: m.num_actual_tokens], prefill)


class ZeroKLAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
                 kv_sharing_target_layer_name=None, **kwargs):
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise ValueError("the zerokl backend supports plain causal attention only")
        if kv_cache_dtype not in ("auto", "bfloat16"):
            raise ValueError(f"the zerokl backend keeps KV in bf16, got kv_cache_dtype={kv_cache_dtype!r}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype

    def forward(self, *args, **kwargs):
        raise RuntimeError("ZeroKLForCausalLM attends in kernels.forward; Attention.forward is never called")


class ZeroKLAttentionBackend(compat.KVLayoutMixin, AttentionBackend):
    supported_dtypes = [torch.bfloat16]
    supported_kv_cache_dtypes = ["auto", "bfloat16"]
    forward_includes_kv_cache_update = True  # vLLM must not write the cache on its own

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the enum member register() binds to this class

    @staticmethod
    def get_impl_cls():
        return ZeroKLAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ZeroKLMetadataBuilder


class PagedKVAdapter:
    """kernels.forward's KV interface over vLLM's per-layer caches, for vLLM's flat token batch
    (the forward sees it as [N, 1]: every token its own row, at its own position).

    Built inside the forward from the metadata's buffers with device ops only (no host sync), so a
    step is captured whole; an eager step with prefill chunks attends per chunk over the flat batch
    (PrefillGroups, kernels.attention_packed).
    """

    def __init__(self, kv_caches: list[torch.Tensor], metadata: ZeroKLAttentionMetadata, head_size: int,
                 num_tokens: int):
        self.kv_caches, self.head_size = kv_caches, head_size
        self.block_table, self.prefill = metadata.block_table, metadata.prefill
        # block tables gathered once per step, not per layer
        self._packed = [] if self.prefill is None else self.prefill.attention_calls(metadata.block_table)
        if self.prefill is None:  # [N, 1] rows: each token's request's block table
            ends = metadata.query_start_loc[1: metadata.num_reqs + 1]
            token = torch.arange(num_tokens, device=ends.device, dtype=ends.dtype)
            # padding tokens past the last request take the last (padding) row
            req = torch.searchsorted(ends, token, right=True).clamp_max_(metadata.num_reqs - 1)
            self.token_block_table = metadata.block_table.index_select(0, req)
        # padding tokens (slot -1) write into block 0, vLLM's null block, which no request reads
        self.slots = metadata.slot_mapping[:num_tokens].clamp_min(0)
        self._cache_index = None  # (block, offset) per token: every layer's pool has the same block size

    def attend(self, ops, layer_idx: int, q, k, v, positions, scale: float) -> torch.Tensor:
        kp, vp = compat.split_kv(self.kv_caches[layer_idx], self.head_size)
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])  # [N, Hkv, D]
        if self._cache_index is None:
            self._cache_index = (self.slots // kp.shape[1], self.slots % kp.shape[1])
        blocks, offsets = self._cache_index
        K.write_kv(kp, vp, blocks, offsets, k, v)  # strided pools: written through the views, one launch
        groups = self.prefill
        if groups is None:
            return ops.attention(q, kp, vp, positions, self.token_block_table, scale)
        if ops.attention_packed is None:
            raise ValueError(f"op set {ops.name!r} has no attention_packed: it cannot attend over vLLM's paged cache")
        rows = q.shape[0]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q_flat, out_flat, pos_flat = q.reshape(rows, *q.shape[2:]), out.view(rows, *q.shape[2:]), positions.reshape(rows)
        out_flat[groups.num_scheduled:].zero_()  # vLLM's padding tokens: no request attends for them
        for starts, lens, tables, longest in self._packed:
            ops.attention_packed(q_flat, kp, vp, pos_flat, tables, starts, lens, longest, out=out_flat, scale=scale)
        return out
