"""The knobs that make a run fit a trainer rank's GPU, each with what it would change in a memory plan
(named in the plan's refusal)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .engine_memory import engine_sleeps, worker_backend_of
from .memory_terms import gib, longest_sequence

if TYPE_CHECKING:
    from .memory_plan import MemoryPlan

# The largest number of ranks the refusal looks at when it says how many would make the run fit, and the
# multiple of tokens the token budget it advises is rounded down to.
MAX_RANKS_ADVISED = 64
BUDGET_STEP = 128

KNOBS = ("trainer.batching.max_tokens_per_micro_batch (fewer tokens per forward and backward), "
         "trainer.batching.activation_checkpointing=true (each layer keeps its input only), trainer.num_ranks (more "
         "GPUs: weights, gradients and AdamW states are sharded over them), rollout.max_tokens (the longest "
         "sequence); on a GPU shared with a rollout engine (placement colocated) also "
         "rollout.engine.gpu_memory_utilization or rollout.engine.vllm_options.kv_cache_memory_bytes (the "
         "engine's share) and rollout.sleep_while_training=true")


def fixes(plan: MemoryPlan) -> list[str]:
    """The knobs, each with what it would change here."""
    lines = [_checkpointing_fix(plan), _budget_fix(plan), _ranks_fix(plan)]
    if plan.colocated:
        lines += _engine_fixes(plan)
    lines.append(_max_tokens_fix(plan))
    return [line for line in lines if line]


def _variant(plan: MemoryPlan, num_ranks: int | None = None, **batching) -> MemoryPlan:
    """The plan with other trainer ranks or trainer.batching values."""
    cfg, rollout, trainer = plan.cfg, plan.cfg.rollout, plan.cfg.trainer
    if num_ranks is not None:
        trainer = dataclasses.replace(trainer, num_ranks=num_ranks)
        if plan.colocated:  # a worker next to each rank
            rollout = dataclasses.replace(rollout, num_workers=num_ranks)
    trainer = dataclasses.replace(trainer, batching=dataclasses.replace(trainer.batching, **batching))
    return dataclasses.replace(plan, cfg=dataclasses.replace(cfg, trainer=trainer, rollout=rollout))


def _verdict(plan: MemoryPlan) -> str:
    return f"total {gib(plan.total)} GiB ({'fits' if plan.fits else 'still too much'})"


def _checkpointing_fix(plan: MemoryPlan) -> str | None:
    if plan.cfg.trainer.batching.activation_checkpointing:
        return None
    other = _variant(plan, activation_checkpointing=True)
    return (f"trainer.batching.activation_checkpointing=true: activations {gib(plan.activations)} -> "
            f"{gib(other.activations)} GiB; {_verdict(other)}")


def _budget_fix(plan: MemoryPlan) -> str:
    now = plan.cfg.trainer.batching.max_tokens_per_micro_batch
    shortest = longest_sequence(plan.cfg, plan.longest_prompt)
    if not _variant(plan, max_tokens_per_micro_batch=shortest).fits:
        return (f"trainer.batching.max_tokens_per_micro_batch (now {now}): even one sequence ({shortest} tokens) per "
                f"micro-batch does not fit with the rest as it is")
    low, high = shortest, max(plan.tokens, shortest)  # low fits; find the largest budget that does
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if _variant(plan, max_tokens_per_micro_batch=mid).fits else (low, mid - 1)
    low = max(shortest, low // BUDGET_STEP * BUDGET_STEP)
    return (f"trainer.batching.max_tokens_per_micro_batch={low} (now {now}; {plan.tokens} tokens in the largest "
            f"micro-batch): the activations follow the tokens of a micro-batch")


def _ranks_fix(plan: MemoryPlan) -> str:
    ranks = plan.cfg.trainer.num_ranks
    states = gib(sum(plan.sharded_states.values()))
    more = ", and rollout.num_workers with it" if plan.colocated else ""
    for r in range(ranks + 1, MAX_RANKS_ADVISED + 1):
        if _variant(plan, num_ranks=r).fits:
            return (f"trainer.num_ranks={r} (now {ranks}; a GPU each{more}): weights, gradients and AdamW "
                    f"states, {states} GiB here, are sharded over the ranks")
    return (f"trainer.num_ranks (now {ranks}): up to {MAX_RANKS_ADVISED} ranks alone do not make it fit; "
            f"their sharded states are {states} GiB here")


def _engine_fixes(plan: MemoryPlan) -> list[str]:
    engine = plan.engine
    lines = [f"rollout.engine.gpu_memory_utilization or rollout.engine.vllm_options.kv_cache_memory_bytes "
             f"(rollout.engine.kv_cache_tokens for the native engine): the engine's share is "
             f"{gib(engine.awake)} GiB awake"]
    if not engine_sleeps(plan.cfg) and worker_backend_of(plan.cfg) == "vllm":
        asleep = dataclasses.replace(plan.cfg, rollout=dataclasses.replace(plan.cfg.rollout,
                                                                           sleep_while_training=True))
        other = dataclasses.replace(plan, cfg=asleep)
        lines.append(f"rollout.sleep_while_training=true: the engine keeps {gib(other.engine.while_training)} "
                     f"GiB while the rank trains instead of {gib(engine.while_training)}; {_verdict(other)}")
    return lines


def _max_tokens_fix(plan: MemoryPlan) -> str:
    longest = longest_sequence(plan.cfg, plan.longest_prompt)
    role = ("the smallest token budget" if plan.cfg.trainer.batching.max_tokens_per_micro_batch > 0
            else "and with it every micro-batch's tokens")
    return (f"rollout.max_tokens (now {plan.cfg.rollout.max_tokens}): with the longest prompt "
            f"({plan.longest_prompt} tokens) it sets the longest sequence, {longest} tokens, {role}")
