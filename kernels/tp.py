"""Tensor parallelism that keeps the canonical numerics: a TP=k forward equals the TP=1 forward bit for bit.

Sharding (Megatron style, k ranks):
  * q/k/v and gate/up projections are split by output features (whole heads per rank), lm_head by vocab
    rows (padded with zero rows to a multiple of k); their per-element reductions are untouched.
  * o_proj and down_proj are split by input features K. The TP=1 canonical matmul sums K in
    S = tree_segments() equal segments combined by the fixed tree ((p0+p1)+(p2+p3))+...; with k | S and
    S | K, rank r's K-slice is exactly segments [r*S/k, (r+1)*S/k), an aligned subtree.
  * embeddings, norms and rotary tables are replicated.

Row-parallel reduction ("tree all-reduce"): each rank computes its subtree node (its S/k segment sums
combined by the same tree, in fp32), the k nodes are all-gathered, and every rank combines them by the
top levels of the same tree, then adds the bias and rounds once. That is the TP=1 tree node for node,
and moves S/k times less data than gathering all S segment partials.

reduce="tree_scatter" does the same adds split by output columns: an all-to-all hands rank r every
rank's node for its N/k columns, rank r combines them by the tree, adds the bias and rounds, and the
rounded slices are all-gathered. Same bits; per output element each rank receives (k-1)/k * (4 + 2)
bytes instead of (k-1) * 4 (4.5 against 12 at k=4; a bf16 ring all-reduce moves about 3).

reduce="tree_p2p" does the same adds with no NCCL at all: the ranks' nodes sit in symmetric memory and
one kernel per rank reads them through NVLink, combines, adds the bias and rounds (kernels.symm_tree;
CUDA only). Same bits again.

Negative control: reduce="all_reduce" sums the same fp32 nodes with dist.all_reduce, whose association
order is the library's (ring, chunked...). For k=2 that is a single commutative add, hence still exact;
for k>=4 the order differs from the tree. reduce_dtype=torch.bfloat16 rounds each rank's result before
the sum, as ordinary TP engines do, and differs at any k.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

import kernels as K

from .forward import CANONICAL_OPS, OpSet, model_spec
from .reference import exact_math as em

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output features
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input features (their bias is replicated)


def supported_degrees() -> tuple[int, ...]:
    """TP degrees that reproduce this process's TP=1 forward: the divisors of tree_segments()."""
    return tuple(d for d in K.TREE_WIDTHS if K.tree_segments() % d == 0)


@dataclasses.dataclass(frozen=True)
class TPShard:
    """What a rank-local model is: rank `rank` of `world_size`, full vocab `vocab_size`."""
    rank: int
    world_size: int
    vocab_size: int
    padded_vocab: int


def check_tp(model: torch.nn.Module, world_size: int) -> None:
    """ValueError unless `model` can be split `world_size` ways with the TP=1 numbers kept."""
    s = K.tree_segments()
    if not isinstance(world_size, int) or world_size < 1 or s % world_size:
        raise ValueError(f"tensor-parallel degree must divide tree_segments()={s} (one of {supported_degrees()}; "
                         f"set {K.TREE_SEGMENTS_ENV} for more), got {world_size!r}")
    spec = model_spec(model)
    inter = model.config.intermediate_size
    problems = []
    if spec.num_heads % world_size or spec.num_kv_heads % world_size:
        problems.append(f"attention heads ({spec.num_heads}) and KV heads ({spec.num_kv_heads}) must be "
                        f"divisible by {world_size}")
    for name, k_dim in (("o_proj", spec.num_heads * spec.head_dim), ("down_proj", inter)):
        if k_dim % s:  # unequal segments at TP=1 would not fall on rank boundaries
            problems.append(f"{name} has K={k_dim}, not a multiple of tree_segments()={s}")
    if problems:
        raise ValueError(f"cannot shard {spec.architecture} {world_size} ways: " + "; ".join(problems))


def _shard_dim(name: str) -> int | None:
    parts = name.split(".")
    owner = parts[-2] if len(parts) >= 2 else ""
    if owner == "lm_head" or owner in COLUMN_PARALLEL:
        return 0
    if owner in ROW_PARALLEL and parts[-1] == "weight":
        return 1
    return None


def shard_tensor(name: str, t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s part of parameter `name` (a view, or `t` itself when replicated)."""
    dim = _shard_dim(name)
    if dim is None or world_size == 1:
        return t
    if name.split(".")[-2] == "lm_head" and t.shape[0] % world_size:
        pad = world_size - t.shape[0] % world_size
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])  # zero rows: logits sliced off after gather
    size = t.shape[dim] // world_size
    return t.narrow(dim, rank * size, size)


def shard_state_dict(state_dict: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state dict from a full (TP=1) one, e.g. for a weight update."""
    return {name: shard_tensor(name, t, rank, world_size).contiguous() for name, t in state_dict.items()}


def shard_model(model: torch.nn.Module, rank: int, world_size: int) -> torch.nn.Module:
    """A rank-local copy of an HF decoder whose config describes the local dims (heads, KV heads and
    MLP width divided by world_size), so model_spec, KVCache and kernels.forward run on it unchanged."""
    check_tp(model, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    spec = model_spec(model)
    lm_head = model.lm_head.weight
    tied = lm_head is model.model.embed_tokens.weight
    memo = {}  # sharded parameters are put in the deepcopy memo, so the full ones are never copied
    for name, p in model.named_parameters(remove_duplicate=False):
        if _shard_dim(name) is None or (tied and p is lm_head):
            continue
        local = shard_tensor(name, p.detach(), rank, world_size).clone()
        memo[id(p)] = torch.nn.Parameter(local, requires_grad=False)
    local_model = copy.deepcopy(model, memo)
    if tied:  # the embedding stays whole; lm_head gets its own vocab shard
        local_model.lm_head.weight = torch.nn.Parameter(
            shard_tensor("lm_head.weight", lm_head.detach(), rank, world_size).clone(), requires_grad=False)
    for mod in local_model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.out_features, mod.in_features = mod.weight.shape
    localize_config(local_model.config, spec, world_size)
    padded = local_model.lm_head.weight.shape[0] * world_size
    local_model.__dict__["_zerokl_tp"] = TPShard(rank, world_size, spec.vocab_size, padded)
    return local_model


def localize_config(config, spec, world_size: int) -> None:
    """Turns the full model's `config` (described by `spec`) into one rank's, in place: heads, KV
    heads and MLP width divided by world_size, lm_head untied (it holds a vocab shard)."""
    config.head_dim = spec.head_dim  # Llama/Qwen2 would otherwise derive it from the local head count
    config.num_attention_heads = spec.num_heads // world_size
    config.num_key_value_heads = spec.num_kv_heads // world_size
    config.intermediate_size = config.intermediate_size // world_size
    config.tie_word_embeddings = False


def local_vocab_rows(vocab_size: int, world_size: int) -> int:
    """Rows of one rank's lm_head shard (the vocab padded with zero rows to a multiple of world_size)."""
    return -(-vocab_size // world_size)


def tp_shard_info(model: torch.nn.Module) -> TPShard | None:
    return model.__dict__.get("_zerokl_tp")


# one flat output buffer (NCCL's fast path); renamed all_gather_single in newer torch
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass(frozen=True)
class Collectives:
    """How one tensor-parallel group moves tensors. `all_gather`: [M, ...] -> [world_size * M, ...],
    rank order; `all_reduce`: the elementwise sum in the library's own order (a new tensor or the
    input); `all_to_all`: [world_size * M, ...] -> the same shape, block j of the input goes to rank j
    and block r of the output came from rank r (None: not offered); `peer_tree(node, bias, out_dtype)`:
    the tree's top levels over peers' memory (kernels.symm_tree; None: not offered; ValueError on
    devices it cannot run on; it returns None for a call it cannot take, which then takes the
    all-gather). collectives(group) builds it over
    a torch process group; a serving engine passes its own communicator (the vLLM plugin: vLLM's TP
    group, which CUDA graphs can capture)."""
    world_size: int
    all_gather: Callable[[torch.Tensor], torch.Tensor]
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    all_to_all: Callable[[torch.Tensor], torch.Tensor] | None = None
    rank: int = 0
    peer_tree: Callable[[torch.Tensor, torch.Tensor | None, torch.dtype], torch.Tensor | None] | None = None


def collectives(group=None) -> Collectives:
    """`group` as Collectives: a torch process group (None: the default group, or a single process
    when torch.distributed is not initialised), or a Collectives, returned as it is."""
    if isinstance(group, Collectives):
        return group
    k = dist.get_world_size(group) if dist.is_initialized() else 1

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = torch.empty((k * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather_flat(out, t, group=group)
        return out

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return Collectives(k, all_gather, all_reduce, all_to_all_over(group), rank, peer_tree_over(group))


def all_to_all_over(group) -> Callable[[torch.Tensor], torch.Tensor]:
    """Collectives.all_to_all over a torch process group (equal blocks along dim 0)."""
    def all_to_all(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=group)
        return out
    return all_to_all


_PEER_TREES: dict = {}  # process group name -> its SymmetricTree (one set of shared buffers per group)


def peer_tree_over(group) -> Callable[[torch.Tensor, torch.Tensor | None, torch.dtype], torch.Tensor | None]:
    """Collectives.peer_tree over a torch process group: its SymmetricTree, made at the first call
    (ValueError there when the group's tensors are not on CUDA)."""
    def peer_tree(node, bias, out_dtype):
        g = group if group is not None else dist.group.WORLD
        tree = _PEER_TREES.get(g.group_name)
        if tree is None:  # imported here: kernels.tp stays importable without torch's symmetric memory
            from .symm_tree import SymmetricTree
            tree = _PEER_TREES[g.group_name] = SymmetricTree(g, node.device)
        return tree(node, bias, out_dtype)
    return peer_tree


def gather_ranks(t: torch.Tensor, comm: Collectives) -> list[torch.Tensor]:
    """[t of group rank 0, t of rank 1, ...]."""
    return list(comm.all_gather(t.contiguous()).view(comm.world_size, *t.shape).unbind(0))


def _subtree(x2: torch.Tensor, w: torch.Tensor, segments: int, out_dtype: torch.dtype) -> torch.Tensor:
    """This rank's node of the segment tree: its `segments` segment sums combined by the fixed tree."""
    return K.backend_for(x2).matmul(x2, w, None, segments=segments, out_dtype=out_dtype)


TREE_REDUCES = ("tree", "tree_scatter", "tree_p2p")  # the exact reductions; all give kernels.matmul's bits


def tree_scatter_combine(node: torch.Tensor, bias: torch.Tensor | None, comm: Collectives,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """The tree's top levels split by output columns (module docstring): node [M, N] fp32 -> [M, N]."""
    if comm.all_to_all is None:
        raise ValueError("reduce='tree_scatter' needs Collectives with an all_to_all")
    k, (m, n) = comm.world_size, node.shape
    pad = -n % k  # zero columns, cut off at the end
    if pad:
        node = torch.nn.functional.pad(node, (0, pad))
        bias = None if bias is None else torch.nn.functional.pad(bias, (0, pad))
    cols = (n + pad) // k
    blocks = node.view(m, k, cols).transpose(0, 1).reshape(k * m, cols)  # block j: rank j's columns
    mine = em.tree_combine(list(comm.all_to_all(blocks).view(k, m, cols).unbind(0)))
    if bias is not None:
        mine = mine + bias[comm.rank * cols:(comm.rank + 1) * cols].float()
    slices = comm.all_gather(mine.to(out_dtype)).view(k, m, cols)
    return slices.transpose(0, 1).reshape(m, k * cols)[:, :n]


def row_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group=None, *,
                        reduce: str = "tree", reduce_dtype: torch.dtype = torch.float32,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Canonical x @ W.T (+ bias) with W's K split across `group` (a process group or Collectives):
    x [..., K/k], weight [N, K/k] is this rank's K-slice, bias [N] replicated. reduce="tree" and
    "tree_scatter" and "tree_p2p" equal kernels.matmul(row_parallel=True) on the full K bit for bit; "all_reduce" is
    the negative control (see the module docstring)."""
    comm = collectives(group)
    k = comm.world_size
    segments = K.tree_segments() // k
    x2 = x.reshape(-1, x.shape[-1])
    if reduce in TREE_REDUCES:
        if reduce_dtype != torch.float32:
            raise ValueError("the tree reduction keeps fp32 partials (reduce_dtype=torch.float32)")
        node = _subtree(x2, weight, segments, torch.float32)
        if reduce == "tree_scatter" and k > 1:
            return tree_scatter_combine(node, bias, comm, out_dtype).reshape(*x.shape[:-1], weight.shape[0])
        if reduce == "tree_p2p" and k > 1:
            if comm.peer_tree is None:
                raise ValueError("reduce='tree_p2p' needs Collectives with a peer_tree")
            out = comm.peer_tree(node, bias, out_dtype)
            if out is not None:
                return out.reshape(*x.shape[:-1], weight.shape[0])
        out = em.tree_combine(gather_ranks(node, comm)) if k > 1 else node
    elif reduce == "all_reduce":
        out = _subtree(x2, weight, segments, reduce_dtype)
        if k > 1:
            out = comm.all_reduce(out)
        out = out.float()
    else:
        raise ValueError(f"reduce must be one of {TREE_REDUCES + ('all_reduce',)}, got {reduce!r}")
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], weight.shape[0]).to(out_dtype)


def tp_ops(base_ops: OpSet, group=None, *, vocab_size: int | None = None, reduce: str | None = None,
           reduce_dtype: torch.dtype | None = None) -> OpSet:
    """`base_ops` for a rank-local model (shard_model) in `group` (a process group or Collectives).

    Column-parallel linears and attention run locally on the rank's heads; row-parallel linears reduce
    across the group; logits are the rank's vocab rows all-gathered (then cut to vocab_size).
    CANONICAL_OPS get the exact tree reduction by default ("tree", or "tree_scatter" / "tree_p2p": the
    same bits, less data moved); other op sets (fast paths) a plain all_reduce in their own dtype, with no
    guarantee.
    """
    canonical = base_ops.name == CANONICAL_OPS.name
    reduce = reduce or ("tree" if canonical else "all_reduce")
    if reduce not in TREE_REDUCES + ("all_reduce",):
        raise ValueError(f"reduce must be one of {TREE_REDUCES + ('all_reduce',)}, got {reduce!r}")
    if reduce in TREE_REDUCES and not canonical:
        raise ValueError("the tree reduction reproduces the canonical matmul; use it with CANONICAL_OPS")
    if reduce in TREE_REDUCES and reduce_dtype not in (None, torch.float32):
        raise ValueError("the tree reduction keeps fp32 partials (reduce_dtype=torch.float32)")
    comm = collectives(group)
    k = comm.world_size

    def linear(x, w, b=None, row_parallel=False):
        if not row_parallel:
            return base_ops.linear(x, w, b)
        if canonical:
            return row_parallel_matmul(x, w, b, comm, reduce=reduce, reduce_dtype=reduce_dtype or torch.float32)
        out = base_ops.linear(x, w, None, row_parallel=True)
        if reduce_dtype is not None:
            out = out.to(reduce_dtype)
        if k > 1:
            out = comm.all_reduce(out)
        out = out.to(x.dtype)
        return out if b is None else out + b

    def logits(x, w):
        local = base_ops.logits(x, w)
        full = torch.cat(gather_ranks(local, comm), dim=-1) if k > 1 else local
        if vocab_size is not None and full.shape[-1] != vocab_size:
            full = full[..., :vocab_size].contiguous()
        return full

    name = f"{base_ops.name}-tp{k}" + ("" if reduce in TREE_REDUCES or not canonical else "-all_reduce")
    # experts are not sharded: the grouped kernels would see shards as whole experts
    return dataclasses.replace(base_ops, name=name, linear=linear, logits=logits, grouped_experts=False)


__all__ = ["COLUMN_PARALLEL", "Collectives", "ROW_PARALLEL", "TPShard", "TREE_REDUCES", "all_to_all_over", "check_tp",
           "collectives", "gather_ranks", "peer_tree_over", "local_vocab_rows", "localize_config", "row_parallel_matmul", "supported_degrees", "shard_model",
           "shard_state_dict", "shard_tensor", "tp_ops", "tp_shard_info", "tree_scatter_combine"]
