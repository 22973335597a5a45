"""A trainer rank's device memory around a train step: what a step that ran out of memory leaves is
dropped, and the allocator's cache is given back before a rollout engine on the same GPU wakes."""
from __future__ import annotations

import gc

import torch

from .memory_plan import MemoryPlan
from .weight_versions import reshard


def drop_failed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    """What a failed step leaves is dropped: FSDP2's iteration state (reset_iter_state waits for the
    collectives in flight and reshards every layer), the partial gradients (the step is lost), and on
    CUDA the allocator's cache."""
    reset = getattr(model, "reset_iter_state", None)
    if reset is not None:
        reset()
    else:  # a torch without FSDPModule.reset_iter_state: every gathered parameter dropped at least
        reshard(model)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def release_cache_for_engine(device: torch.device, plan: MemoryPlan | None) -> None:
    """Rule: a CUDA rank gives its cached memory back (torch.cuda.empty_cache) before a rollout engine
    sleeping on its GPU wakes (colocated placement). The last backward has freed the activations, but
    PyTorch's caching allocator keeps their blocks for this process, where the waking engine, another
    process, cannot map them. Where no engine wakes on the GPU the cache is kept: the next step reuses
    it without allocating from the device again."""
    if device.type == "cuda" and plan is not None and plan.engine_wakes_after_step:
        torch.cuda.empty_cache()


def allocator_counts(device: torch.device) -> tuple[int, int]:
    """The caching allocator's counts so far on a CUDA device: (cudaMalloc calls, retries: allocations that
    found the device full, freed the cache and tried again, a device-wide sync each)."""
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)
