"""What the CPU and GPU packing tests share: rollouts of varied lengths from the engine, scoring a micro-batch
in either layout, and a TrainerRank (FSDP2, one rank) run in this process."""
from __future__ import annotations

import socket

import torch

from recipes.batch import Sample, split_for_ranks
from rollout_service import Engine, SamplingParams
from trainer_patch import stock_token_logprobs, token_logprobs


def rollout_samples(checkpoint: str, lengths: list[int], vocab: int, device: str) -> list[Sample]:
    """One rollout per length (the engine's own seeded sampling, max_tokens = the length) as training
    samples, advantages alternating in sign."""
    engine = Engine(checkpoint, fast_path="native", window=8, group=16, device=device)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (2 + i % 5,), generator=gen).tolist() for i in range(len(lengths))]
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=100 + i) for i, n in enumerate(lengths)]
    rollouts = engine.generate(prompts, params)
    assert [len(r.token_ids) for r in rollouts] == lengths
    return [Sample(p, r.token_ids, r.logprobs, (-1.0) ** i) for i, (p, r) in enumerate(zip(prompts, rollouts))]


def per_sample(mb: dict, logp: torch.Tensor, samples: list[Sample]) -> list[list[float]]:
    """Each sample's generated-token log-probs out of a micro-batch (samples in the batch's order)."""
    flat = logp[mb["loss_mask"].to(logp.device)].tolist()
    out, start = [], 0
    for s in samples:
        out.append(flat[start:start + len(s.token_ids)])
        start += len(s.token_ids)
    return out


def score(model, mb: dict, stock: bool = False) -> torch.Tensor:
    """Log-probs of a micro-batch of either layout: the canonical forward, or the stock one."""
    device = model.model.embed_tokens.weight.device
    layout = ({"position_ids": mb["position_ids"].to(device)} if "position_ids" in mb else
              {"attention_mask": mb["attention_mask"].to(device)})
    ids = mb["input_ids"].to(device)
    if stock:
        return stock_token_logprobs(model, ids, **{"attention_mask": None, **layout})
    return token_logprobs(model, ids, temperature=1.0, **layout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_step_in_process(cfg, model, samples: list[Sample]) -> dict:
    """One train step of a TrainerRank (FSDP2, world 1) on `samples` laid out as cfg says."""
    from recipes.trainer import TrainerRank

    rank = TrainerRank(0, 1, cfg, temperature=1.0)
    try:
        rank.setup("127.0.0.1", free_port(), model)
        batching = cfg.batching
        plans, tokens = split_for_ranks(samples, 1, 1, batching.micro_batch_size, 0,
                                        batching.max_tokens_per_micro_batch, batching.packing)
        return rank.train_step(plans[0], tokens)
    finally:
        rank.close()
