"""The canonical contract: everything besides the weights, token ids and positions that fixes the
canonical numbers, in one frozen configuration, with its one check.

Two processes whose CanonicalConfig is equal compute bit-identical log-probs from the same bf16
weights; the rollout workers, the trainer ranks and the recipe all compare it through
`check_canonical`, which raises CanonicalMismatchError.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

# Bumped whenever a kernel's arithmetic changes (a new version never promises the old bits).
KERNELS_VERSION = "0.3.0"

# Segments of the row-parallel segment tree: the largest tensor-parallel degree whose forward equals
# this one. Fewer are faster (1: no tree, the plain canonical matmul) and allow fewer TP degrees.
TREE_WIDTHS = (1, 2, 4, 8)
TREE_SEGMENTS_ENV = "ZEROKL_TREE_SEGMENTS"


@dataclass(frozen=True)
class KernelFamily:
    """A backend's fixed reduction sizes: changing either changes the bits."""
    name: str
    matmul_block_k: int  # K elements folded into the fp32 accumulator per step, in order from k = 0
    attention_block_kv: int  # KV positions per online-softmax block, from position 0
    # KV positions per split, from position 0 (a multiple of attention_block_kv): each split runs its
    # own online softmax and a row's splits are merged in order. Decode steps reduce the splits of a
    # long context in parallel (split-KV) and prefill walks them in one program: same bits.
    attention_split_kv: int


def check_attention_blocks(block_kv: int, split_kv: int) -> None:
    """A split must hold whole KV blocks: both attention families cut their loops on that."""
    if block_kv <= 0 or split_kv <= 0 or split_kv % block_kv:
        raise ValueError(f"split_kv ({split_kv}) must be a positive multiple of block_kv ({block_kv})")


# Plain torch (any device): sequential rank-1 updates over K; attention in blocks of 16 keys, splits
# of 32 (small, so that CPU tests cross split boundaries).
REFERENCE = KernelFamily("reference", matmul_block_k=1, attention_block_kv=16, attention_split_kv=32)
# Triton on CUDA: one tensor-core dot per 64 K-elements; attention in blocks of 64 keys, splits of 512.
TRITON = KernelFamily("triton", matmul_block_k=64, attention_block_kv=64, attention_split_kv=512)


def _valid_tree_segments(value, source: str) -> int:
    try:
        segments = int(value)
    except (TypeError, ValueError):
        segments = None
    if segments not in TREE_WIDTHS or isinstance(value, (bool, float)):
        raise ValueError(f"{source} must be one of {TREE_WIDTHS} (the largest TP degree to reproduce), got {value!r}")
    return segments


_tree_segments = _valid_tree_segments(os.environ.get(TREE_SEGMENTS_ENV, "8"), TREE_SEGMENTS_ENV)


def tree_segments() -> int:
    """Segments of the row-parallel tree in this process: ZEROKL_TREE_SEGMENTS (default 8), or the
    last set_tree_segments()."""
    return _tree_segments


def set_tree_segments(segments: int) -> None:
    """Change the row-parallel tree for this process; do it before building engines or patching
    models (captured CUDA graphs keep the kernels they were captured with)."""
    global _tree_segments
    _tree_segments = _valid_tree_segments(segments, "tree_segments")


@dataclass(frozen=True)
class CanonicalConfig:
    kernels_version: str
    device_type: str  # CPU and GPU kernels are each invariant, but need not agree with each other
    kernel_family: str
    matmul_block_k: int
    attention_block_kv: int
    attention_split_kv: int
    tree_segments: int

    def describe(self) -> str:
        return (f"kernels {self.kernels_version} on {self.device_type} ({self.kernel_family}, "
                f"block_k {self.matmul_block_k}, block_kv {self.attention_block_kv}, "
                f"split_kv {self.attention_split_kv}, "
                f"tree {self.tree_segments})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class CanonicalMismatchError(RuntimeError):
    """Processes that must compute the same log-probs run different canonical forwards (another
    device type or kernel family, another ZEROKL_TREE_SEGMENTS, another kernels version)."""


def check_canonical(configs: dict[str, CanonicalConfig]) -> CanonicalConfig:
    """All `configs` (who -> its contract) must be equal; returns the common one.

    The one comparison used by the pool (its workers, a restarted worker), the trainer (its ranks)
    and the recipe (pool against trainer).
    """
    if not configs:
        raise ValueError("check_canonical needs at least one configuration")
    for who, cfg in configs.items():
        if not isinstance(cfg, CanonicalConfig):
            raise TypeError(f"{who} reported {type(cfg).__name__}, not a CanonicalConfig")
    groups: dict[CanonicalConfig, list[str]] = {}
    for who, cfg in configs.items():
        groups.setdefault(cfg, []).append(who)
    if len(groups) > 1:
        detail = "; ".join(f"{', '.join(names)}: {cfg.describe()}" for cfg, names in groups.items())
        raise CanonicalMismatchError(f"their log-probs would differ, they run different canonical forwards: {detail}")
    return next(iter(groups))
