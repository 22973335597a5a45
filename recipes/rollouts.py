"""Which prompts a step uses, the seeded group requests it sends, and a digest of what came back.

Seeds, completion budgets (max_tokens) and prompt order are pure functions of (run seed, step, prompt
index, sample index), so a resumed run sends exactly the requests the uninterrupted run would have sent.
"""
from __future__ import annotations

import functools
import hashlib
import math
import random
import statistics
import struct

from kernels.moe import moe_spec
from rollout_service.params import Rollout, SamplingParams
from rollout_service.engine.protocol import EngineCapabilities

from .config import RolloutConfig


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int, turn: int = 0) -> int:
    """A 63-bit sampling seed for one rollout (turn > 0: a later turn of a multi-turn episode)."""
    key = f"grpo/{run_seed}/{step}/{prompt_index}/{sample_index}{f'/{turn}' if turn else ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2 ** 63 - 1)


_STANDARD_NORMAL = statistics.NormalDist()


def completion_budget(run_seed: int, step: int, prompt_index: int, sample_index: int, distribution: str,
                      cap: int, median: int | None = None, sigma: float = 0.0) -> int:
    """One rollout's max_tokens (rollout.length_distribution): `cap` for "fixed"; for "lognormal",
    round(median * exp(sigma * z)) clipped to [1, cap], z a standard normal drawn from a hash of the
    key (its inverse CDF at a uniform in (0, 1)), so a draw repeats across runs and resumes.

    A completion stops at its budget unless the model emits EOS (or a stop token) first; the
    benchmarks' random models almost never do (1 in ~150k tokens over Qwen's vocabulary of 151936),
    so there a completion's length is its drawn budget."""
    if distribution == "fixed":
        return cap
    if distribution != "lognormal":
        raise ValueError(f"unknown length distribution {distribution!r}; fixed | lognormal")
    key = f"length/{run_seed}/{step}/{prompt_index}/{sample_index}".encode()
    bits = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 11  # 53 bits
    z = _STANDARD_NORMAL.inv_cdf((bits + 0.5) / 2 ** 53)
    return max(1, min(cap, round(median * math.exp(sigma * z))))


def rollout_budget(rollout: RolloutConfig, run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """completion_budget under the `rollout` section's length settings."""
    return completion_budget(run_seed, step, prompt_index, sample_index, rollout.length_distribution,
                             rollout.max_tokens, rollout.length_median, rollout.length_sigma)


@functools.lru_cache(maxsize=4)
def epoch_order(size: int, run_seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"order/{run_seed}/{epoch}").shuffle(order)
    return tuple(order)


def prompt_indices(cursor: int, count: int, size: int, run_seed: int) -> list[int]:
    """Dataset indices of prompts cursor .. cursor+count-1 of the endless seeded epoch sequence."""
    out = []
    for pos in range(cursor, cursor + count):
        epoch, offset = divmod(pos, size)
        out.append(epoch_order(size, run_seed, epoch)[offset])
    return out


def group_requests(prompts: list[list[int]], indices: list[int], step: int, rollout: RolloutConfig, run_seed: int,
                   stop_token_ids: tuple[int, ...], routed_experts: bool = False, adapter: str | None = None
                   ) -> tuple[list[list[int]], list[SamplingParams]]:
    """rollout.n requests per prompt (prompt-major order), each with its own derived seed and max_tokens
    (rollout_budget). routed_experts: ask for each token's MoE routing (`records_routing`). adapter: the
    LoRA adapter every request runs with (model.lora.name), or None: the base."""
    r = rollout
    all_prompts, all_params = [], []
    for prompt, index in zip(prompts, indices):
        for j in range(r.n):
            all_prompts.append(list(prompt))
            all_params.append(SamplingParams(
                max_tokens=rollout_budget(r, run_seed, step, index, j), temperature=r.temperature, top_k=r.top_k,
                top_p=r.top_p,
                seed=sample_seed(run_seed, step, index, j), stop_token_ids=tuple(stop_token_ids),
                determinism=r.determinism, return_routed_experts=routed_experts, adapter=adapter))
    return all_prompts, all_params


def engine_options(cfg) -> dict:
    """rollout.engine, plus what the run's numerics and placement ask of every engine (options each
    engine takes, rollout_service.engine.config): `off` requests only for numerics stock (stock_only),
    built to release memory where the engines sleep (sleep_mode, engines_sleep), and with model.lora one
    adapter of its settings (max_loras, max_lora_rank, lora_settings: what a vLLM engine is built with)."""
    options = dict(cfg.rollout.engine)
    if cfg.model.lora is not None:  # a vLLM engine serves adapters only where built for them
        from recipes.lora import adapter_settings
        from rollout_service.vllm.adapters import vllm_lora_rank
        settings = adapter_settings(cfg.model.lora)
        options.setdefault("max_loras", 1)
        options.setdefault("max_lora_rank", vllm_lora_rank(settings["r"]))
        options.setdefault("lora_settings", settings)
    if cfg.numerics == "stock":
        options.setdefault("stock_only", True)
    if engines_sleep(cfg):
        options.setdefault("sleep_mode", True)
    return options


def engines_sleep(cfg) -> bool:
    """Whether the rollout engines release their memory while the trainer steps: colocated runs, unless
    rollout.sleep_while_training is false."""
    return cfg.placement == "colocated" and cfg.rollout.sleep_while_training


def records_routing(rollout: RolloutConfig, model, capabilities: EngineCapabilities) -> bool:
    """Whether rollouts record their MoE routing: rollout.return_routed_experts, or when that is null,
    for an MoE policy on a pool whose every engine can (`capabilities`, RolloutClient.capabilities: the
    native engine without tensor parallelism; vLLM refuses the flag, TP does not record routing yet)."""
    if rollout.return_routed_experts is not None:
        return rollout.return_routed_experts
    return moe_spec(model.config) is not None and capabilities.routing_records


def rollouts_digest(rollouts: list[Rollout]) -> str:
    """sha256 over every rollout's prompt, tokens, the exact bits of its log-probs and its routing
    (when recorded)."""
    h = hashlib.sha256()
    for ro in rollouts:
        h.update(struct.pack(f"<{len(ro.prompt_token_ids)}q", *ro.prompt_token_ids))
        h.update(b"|")
        h.update(struct.pack(f"<{len(ro.token_ids)}q", *ro.token_ids))
        h.update(struct.pack(f"<{len(ro.logprobs)}d", *ro.logprobs))
        h.update(str(ro.finish_reason).encode() + b";")
        if ro.routed_experts is not None:
            flat = [e for token in ro.routed_experts for layer in token for e in layer]
            h.update(b"routing" + struct.pack(f"<{len(flat)}q", *flat))
    return h.hexdigest()
