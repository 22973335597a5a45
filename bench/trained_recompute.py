"""How often DVR rolls back with trained weights vs random ones: trains a small byte-level model on
GSM8K text, then decodes the same prompts with DVR on every step (fast path proposes, the canonical
verifier replays) for the trained model and for its random initialisation; prints JSON.

    python -m bench.trained_recompute --data path/to/gsm8k/train.jsonl --steps 600

Random weights give near-flat next-token distributions, so the fast path's and the verifier's
sampled tokens part more often than a trained model's would; this measures by how much, on one shape.
The records are read with the json module (`question` and `answer` fields), so it runs where
`datasets` is not installed.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time

import torch
import transformers
from tqdm import tqdm

from bench import emit
from bench.rollout import run
from rollout_service.tiny_models import tiny_config
from rollout_service import Engine

VOCAB = 256  # bytes


def load_texts(path: str) -> list[str]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in records]


def build(args, device: str):
    cfg = tiny_config("qwen2", vocab_size=VOCAB, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=args.hidden // 64, num_kv_heads=2, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                      max_positions=4096)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).to(device)


def train(model, stream: torch.Tensor, args) -> list[float]:
    """Next-byte prediction on random windows of the corpus; returns the loss (nats/byte) per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    losses = []
    model.train()
    for step in tqdm(range(args.steps), desc="train", mininterval=5):
        lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, stream.numel() - args.seq - 1, (args.batch,), generator=gen)
        ids = torch.stack([stream[s:s + args.seq + 1] for s in starts.tolist()]).to(model.device)
        with torch.autocast(model.device.type, dtype=torch.bfloat16):
            logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def dvr_stats(model, prompts, args, device: str) -> dict:
    model = copy.deepcopy(model).to(torch.bfloat16).eval()
    tokens = len(prompts) * (max(map(len, prompts)) + args.output_len + args.window + 16)
    engine = Engine(model, device=device, window=args.window, group=args.group, copy_model=False,
                    kv_cache_tokens=tokens, max_num_seqs=len(prompts), max_prefill_tokens=8192)
    run(engine, prompts, "verified-dvr", 2 * args.window, args.temperature)  # warm-up
    return run(engine, prompts, "verified-dvr", args.output_len, args.temperature)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="GSM8K-style JSONL (question, answer per line)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    texts = load_texts(args.data)
    random.Random(0).shuffle(texts)
    held_out, corpus = texts[:args.prompts], texts[args.prompts:]
    stream = torch.tensor(list("".join(corpus).encode("utf-8")), dtype=torch.long)
    prompts = [list(t.split("\nAnswer:")[0].encode("utf-8")) + list(b"\nAnswer:") for t in held_out]

    model = build(args, args.device)
    random_stats = dvr_stats(model, prompts, args, args.device)
    t0 = time.perf_counter()
    losses = train(model, stream, args)
    doc = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               model=dict(hidden=args.hidden, layers=args.layers, vocab=VOCAB,
                          params=sum(p.numel() for p in model.parameters())),
               train=dict(steps=args.steps, tokens=args.steps * args.batch * args.seq,
                          seconds=round(time.perf_counter() - t0, 1),
                          first_loss=round(losses[0], 3), final_loss=round(sum(losses[-20:]) / len(losses[-20:]), 3)),
               window=args.window, temperature=args.temperature, prompts=len(prompts), output_len=args.output_len,
               random_init=random_stats, trained=dvr_stats(model, prompts, args, args.device))
    emit(doc, args.out)


if __name__ == "__main__":
    main()
