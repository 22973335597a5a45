"""The plugin's model under vLLM's own tensor parallelism (`tensor_parallel_size=k`).

Each of vLLM's k workers builds one rank's shard of the canonical model (kernels.tp: whole heads and
MLP columns per rank, o_proj / down_proj split along K into aligned subtrees of the segment tree, the
lm_head by vocab rows) and loads its slice of every checkpoint tensor. Row-parallel outputs are
combined by the tree through vLLM's TP group: the ranks' fp32 subtree nodes are all-gathered and
summed in the tree's order, so every rank holds the TP=1 result bit for bit. vLLM's all-reduce never
touches them. On GPUs the default is "tree_p2p" (below); elsewhere "tree".

`additional_config={TP_REDUCE_KEY: "tree_scatter"}` does the same adds split by output columns (an
all-to-all, each rank combining its columns by the tree, then an all-gather of the rounded columns:
the same bits with less data moved, kernels.tp); "tree_p2p" reads the peers' nodes through NVLink
from symmetric memory in one kernel, with no NCCL (kernels.symm_tree; CUDA only). `additional_config={TP_REDUCE_KEY:
"bf16_all_reduce"}` is the negative control: each rank rounds its row-parallel output to bf16 and
vLLM's all-reduce sums them, as stock vLLM models do.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import torch

from kernels.forward import CANONICAL_OPS, ModelSpec, OpSet, model_spec
from kernels.tp import (TREE_REDUCES, Collectives, all_to_all_over, check_tp, local_vocab_rows, localize_config,
                        peer_tree_over, shard_tensor, tp_ops)

TP_REDUCE_KEY = "zerokl_tp_reduce"
TP_REDUCES = ("tree", "tree_scatter", "tree_p2p", "bf16_all_reduce")


def default_reduce() -> str:
    """"tree_p2p" where GPUs can read each other's memory (one kernel reads the peers' nodes: the
    fastest of the trees end to end, bench/results/2026-11-26-h100x2), else "tree"."""
    from kernels.symm_tree import symmetric_memory_available
    return "tree_p2p" if torch.cuda.is_available() and symmetric_memory_available(torch.device("cuda")) else "tree"


@dataclasses.dataclass(frozen=True)
class PluginTP:
    """This worker's place in vLLM's tensor-parallel group and how row-parallel outputs are summed."""
    rank: int = 0
    world_size: int = 1
    reduce: str = "tree"  # from_vllm: additional_config[TP_REDUCE_KEY], else default_reduce()

    @classmethod
    def from_vllm(cls, vllm_config) -> "PluginTP":
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise NotImplementedError("ZeroKLForCausalLM runs on a single pipeline stage (pipeline_parallel_size=1)")
        extra = vllm_config.additional_config
        reduce = extra.get(TP_REDUCE_KEY, default_reduce()) if isinstance(extra, dict) else default_reduce()
        if reduce not in TP_REDUCES:
            raise ValueError(f"additional_config[{TP_REDUCE_KEY!r}] must be one of {TP_REDUCES}, got {reduce!r}")
        k = parallel.tensor_parallel_size
        if k == 1:
            return cls(reduce=reduce)
        if reduce == "tree_p2p" and not torch.cuda.is_available():
            raise ValueError(f"additional_config[{TP_REDUCE_KEY!r}]='tree_p2p' reads peer GPUs' memory and needs "
                             "CUDA; use 'tree' or 'tree_scatter' here")
        from vllm.distributed.parallel_state import get_tp_group
        return cls(get_tp_group().rank_in_group, k, reduce)

    def local_config(self, hf_config):
        """The config of this rank's shard; ValueError when the model cannot be split k ways with the
        TP=1 numbers kept (kernels.tp.check_tp)."""
        if self.world_size == 1:
            return hf_config
        config = copy.deepcopy(hf_config)
        localize_config(config, check_split(hf_config, self.world_size), self.world_size)
        return config

    def shard_lm_head(self, hf: torch.nn.Module, vocab_size: int) -> None:
        """Gives the shard's lm_head its own [ceil(vocab / k), hidden] parameter (uninitialised)."""
        if self.world_size == 1:
            return
        w = hf.lm_head.weight
        rows = local_vocab_rows(vocab_size, self.world_size)
        hf.lm_head.weight = torch.nn.Parameter(w.new_empty(rows, w.shape[1]), requires_grad=False)
        hf.lm_head.out_features = rows

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of checkpoint tensor `name` (per-expert tensors are replicated)."""
        if self.world_size == 1 or ".mlp.experts." in name:
            return tensor
        return shard_tensor(name, tensor, self.rank, self.world_size)

    def ops(self, vocab_size: int) -> OpSet:
        if self.world_size == 1:
            return CANONICAL_OPS
        if self.reduce in TREE_REDUCES:
            return tp_ops(CANONICAL_OPS, vllm_collectives(), vocab_size=vocab_size, reduce=self.reduce)
        return tp_ops(CANONICAL_OPS, vllm_collectives(), vocab_size=vocab_size, reduce="all_reduce",
                      reduce_dtype=torch.bfloat16)


def vllm_collectives() -> Collectives:
    """vLLM's TP group as kernels.tp Collectives: its own all-gather and all-reduce (NCCL / custom
    all-reduce on GPU, shared memory or gloo on CPU; usable while vLLM captures CUDA graphs), and an
    all-to-all and the peer-to-peer tree over its torch device group (vLLM's group offers neither)."""
    from vllm.distributed.parallel_state import get_tp_group
    group = get_tp_group()
    return Collectives(group.world_size, lambda t: group.all_gather(t, dim=0), group.all_reduce,
                       all_to_all_over(group.device_group), group.rank_in_group, peer_tree_over(group.device_group))


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_CPU_BINDING: dict[str, str] = {}  # the value tp_options last set (a user's own value is left alone)


def check_split(hf_config, tensor_parallel_size: int) -> ModelSpec:
    """The full model's spec; ValueError unless it can run k = tensor_parallel_size ways with the
    TP=1 numbers kept (kernels.tp.check_tp). Builds the model on the meta device: no memory."""
    import transformers
    with torch.device("meta"):
        full = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))
    check_tp(full, tensor_parallel_size)
    return model_spec(full)


def tp_options(model: str | os.PathLike | None, tensor_parallel_size: int) -> dict:
    """vLLM keywords for the plugin on k = tensor_parallel_size workers: vLLM's multiprocessing
    executor. Checks the checkpoint first (check_split). On CPU, sets VLLM_CPU_OMP_THREADS_BIND
    (unless the user set it) to one core per rank, round robin: vLLM's CPU build otherwise wants a
    NUMA node per rank."""
    k = tensor_parallel_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {k!r}")
    if k == 1:
        return {}
    if model is not None:  # before any vLLM worker starts
        import transformers
        check_split(transformers.AutoConfig.from_pretrained(str(model)), k)
    if not torch.cuda.is_available() and os.environ.get(CPU_BIND_ENV) in (None, _CPU_BINDING.get("ours")):
        cores = sorted(os.sched_getaffinity(0))
        os.environ[CPU_BIND_ENV] = _CPU_BINDING["ours"] = "|".join(str(cores[r % len(cores)]) for r in range(k))
    return dict(tensor_parallel_size=k, distributed_executor_backend="mp")
