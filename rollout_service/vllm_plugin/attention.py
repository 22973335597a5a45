"""An attention backend that only manages KV: vLLM allocates the paged cache and builds the batch's
metadata; the canonical forward (kernels.forward) writes K/V and attends through `PagedKVAdapter`.

The model never calls `Attention.forward`, so the impl's forward is unreachable; the Attention
layers exist so that vLLM sizes, allocates and binds a cache per decoder layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadataBuilder, CommonAttentionMetadata)

from . import compat


@dataclass
class ZeroKLAttentionMetadata:
    """Views of the model runner's persistent input buffers, nothing derived: everything computed
    from them happens inside the forward, so a captured CUDA graph reads this step's values."""
    num_reqs: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64 flat slot per token; -1 for padding tokens


class ZeroKLMetadataBuilder(AttentionMetadataBuilder[ZeroKLAttentionMetadata]):
    # The forward has no host syncs and fixed shapes per token count, so vLLM may replay decode
    # steps (one token per request) from full CUDA graphs; mixed prefill batches run eagerly.
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold = None  # the [N, 1] layout does not care about batch order

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ZeroKLAttentionMetadata:
        m = common_attn_metadata
        return ZeroKLAttentionMetadata(int(m.num_reqs), m.query_start_loc, m.block_table_tensor,
                                       m.slot_mapping[: m.num_actual_tokens])


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
    """kernels.forward's KV interface over vLLM's per-layer caches, for a [N, 1] token batch.

    Built inside the forward from the metadata's buffers with device ops only (no host sync), so it
    is captured with the rest of a decode step.
    """

    def __init__(self, kv_caches: list[torch.Tensor], metadata: ZeroKLAttentionMetadata, head_size: int,
                 num_tokens: int):
        self.kv_caches, self.head_size = kv_caches, head_size
        ends = metadata.query_start_loc[1: metadata.num_reqs + 1]
        token = torch.arange(num_tokens, device=ends.device, dtype=ends.dtype)
        # each token's request; padding tokens past the last request take the last (padding) row
        req = torch.searchsorted(ends, token, right=True).clamp_max_(metadata.num_reqs - 1)
        self.token_block_table = metadata.block_table.index_select(0, req)
        # padding tokens (slot -1) write into block 0, vLLM's null block, which no request reads
        self.slots = metadata.slot_mapping[:num_tokens].clamp_min(0)

    def write_and_get(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        kp, vp = compat.split_kv(self.kv_caches[layer_idx], self.head_size)
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])  # [N, Hkv, D]
        block_size = kp.shape[1]
        blocks, offsets = self.slots // block_size, self.slots % block_size
        kp[blocks, offsets] = k.to(kp.dtype)  # strided pools: index_put writes through the view
        vp[blocks, offsets] = v.to(vp.dtype)
        return kp, vp, self.token_block_table
