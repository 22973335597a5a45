"""A short supervised warm-up so that a random tiny policy starts with some reward to improve on.

It uses the model's ordinary (unpatched) forward in float32: speed matters here, not canonical
numerics. The result is cast back to bf16 and becomes the run's starting weights.
"""
from __future__ import annotations

import copy

import torch


def sft_batch(examples: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 except on target tokens)."""
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (prompt, target) in enumerate(examples):
        seq = prompt + target
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, len(prompt):len(seq)] = torch.tensor(target)
    return ids, labels


def supervised_warmup(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]], steps: int,
                      lr: float = 3e-3, batch_size: int = 64, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """`steps` AdamW steps on (prompt ids, target ids) pairs on `device`; returns a new bf16 model on
    the host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only add contention
    try:
        return _train(model, examples, steps, lr, batch_size, seed, torch.device(device))
    finally:
        torch.set_num_threads(threads)


def _train(model, examples, steps, lr, batch_size, seed, device):
    work = copy.deepcopy(model).to(device).float().train()
    opt = torch.optim.AdamW(work.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = torch.randint(0, len(examples), (batch_size,), generator=gen).tolist()
        ids, labels = sft_batch([examples[i] for i in pick])
        loss = work(input_ids=ids.to(device), labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model = work.to("cpu", torch.bfloat16).eval()
    del work, opt
    if device.type == "cuda":  # the workers and ranks about to start on this GPU need the memory back
        torch.cuda.empty_cache()
    return model


def answer_examples(task) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids + stop token) for every prompt of the task: the answer, or where the task's rows
    have one, the "target" (a multi-turn task's solved episode, tool calls and observations included)."""
    tok, stop = task.tokenizer, task.stop_token_ids[0]
    return [(list(row["prompt_ids"]), tok.encode(row.get("target", row["answer"]), add_special_tokens=False) + [stop])
            for row in task.dataset]
