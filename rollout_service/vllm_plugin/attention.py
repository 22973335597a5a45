"""An attention backend that only manages KV: vLLM allocates the paged cache and builds the batch's
metadata; the canonical forward (kernels.forward) writes K/V and attends through `PagedKVAdapter`.

The model never calls `Attention.forward`, so the impl's forward is unreachable; the Attention
layers exist so that vLLM sizes, allocates and binds a cache per decoder layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)

from . import compat


@dataclass
class ZeroKLAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64 flat slot per token
    token_block_table: torch.Tensor  # [num_actual_tokens, max_blocks]: each token's sequence's table
    keep: torch.Tensor | None  # indices of tokens with a slot (None: all have one)


class ZeroKLMetadataBuilder(AttentionMetadataBuilder[ZeroKLAttentionMetadata]):
    reorder_batch_threshold = None  # the [N, 1] layout does not care about batch order

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ZeroKLAttentionMetadata:
        m = common_attn_metadata
        n = int(m.num_actual_tokens)
        starts = m.query_start_loc_cpu[: m.num_reqs + 1].to(torch.int64)
        req = torch.repeat_interleave(torch.arange(m.num_reqs), starts[1:] - starts[:-1])[:n]
        table = m.block_table_tensor[: m.num_reqs]
        slots = m.slot_mapping[:n].to(torch.int64)
        has_slot = slots >= 0
        keep = None if bool(has_slot.all()) else has_slot.nonzero().squeeze(1)  # one sync per step
        return ZeroKLAttentionMetadata(n, slots, table[req.to(table.device)], keep)


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
    """kernels.forward's KV interface over vLLM's per-layer caches, for a [N, 1] token batch."""

    def __init__(self, kv_caches: list[torch.Tensor], metadata: ZeroKLAttentionMetadata, head_size: int):
        self.kv_caches, self.md, self.head_size = kv_caches, metadata, head_size

    def write_and_get(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        kp, vp = compat.split_kv(self.kv_caches[layer_idx], self.head_size)
        slots = self.md.slot_mapping
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])  # [N, Hkv, D]
        if self.md.keep is not None:  # tokens vLLM gave no slot (never read back)
            slots, k, v = slots[self.md.keep], k[self.md.keep], v[self.md.keep]
        block_size = kp.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        kp[blocks, offsets] = k.to(kp.dtype)  # strided pools: index_put writes through the view
        vp[blocks, offsets] = v.to(vp.dtype)
        return kp, vp, self.md.token_block_table
