"""Paged KV cache: per-layer block pools and a free-list block allocator.

The fast path and the verifier share one cache: the verifier overwrites the slots of a verify window
with canonical K/V, so after every verification the committed prefix has canonical KV.
"""
from __future__ import annotations

import torch

from kernels.forward import ModelSpec


class OutOfBlocks(RuntimeError):
    pass


class KVCache:
    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, device: torch.device | str):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        # one extra block that is never handed out: padding tokens of a batch write their K/V there
        shape = (num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(spec.num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_slot = num_blocks * block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure(self, block_ids: list[int], num_tokens: int) -> None:
        """Grow `block_ids` in place to hold `num_tokens` slots, all or nothing."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} blocks, {len(self._free)} free")
        for _ in range(max(need, 0)):
            block_ids.append(self._free.pop())

    def release(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
        block_ids.clear()
