"""What the trainer patch costs: forward + backward of the canonical forward vs the unpatched Hugging
Face model (cuBLAS, SDPA), per row-parallel tree width; prints JSON.

    python -m bench.train_step --model qwen1.5b --batch 4 --seq 2048 --widths 8,4,1
    python -m bench.train_step --model llama8b --layers 8          # fewer layers, same layer shapes

A step: logits -> token log-probs -> mean -> backward (the canonical forward's backward is the
ordinary one); a forward: the logits alone, no grad. `canonical_scored` is the step the trainer runs:
log-probs straight from the patched forward (ScoreTokens), no full-vocabulary logits in autograd. Tokens/s of each per variant and the canonical /
unpatched ratio, timed in one process.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import kernels as K
import trainer_patch
from bench.rollout import SHAPES, build_model


def _step(model, ids):
    logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])
    logp.mean().backward()


def _scored_step(model, ids):
    """The trainer's own path: only the scored tokens pass through the lm head (trainer_patch.ScoreTokens)."""
    positions = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
    model(input_ids=ids, zerokl_score=trainer_patch.ScoreTokens(positions, 1.0)).log_probs.mean().backward()


def _forward(model, ids):
    with torch.no_grad():
        model(input_ids=ids)


def _time_both(model, ids, repeats, device) -> dict:
    return {"forward": _seconds(lambda: _forward(model, ids), repeats, device),
            "step": _seconds(lambda: _step(model, ids), repeats, device)}


def _seconds(fn, repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # compiles, allocator growth
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--widths", default="8,4,1", help=f"tree widths to time, from {K.TREE_WIDTHS}")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    widths = [int(w) for w in args.widths.split(",")]
    ids = torch.randint(0, SHAPES[args.model]["vocab_size"], (args.batch, args.seq), device=device)
    tokens = args.batch * args.seq
    model = build_model(args.model, args.device, args.layers).train().requires_grad_(True)
    rows = {"unpatched": _time_both(model, ids, args.repeats, device)}
    trainer_patch.patch_model(model)  # in place: from here on the same weights run the canonical forward
    before = K.tree_segments()
    try:
        for width in widths:
            K.set_tree_segments(width)
            rows[f"canonical_tree{width}"] = _time_both(model, ids, args.repeats, device)
        K.set_tree_segments(widths[0])
        rows[f"canonical_scored_tree{widths[0]}"] = {"step": _seconds(lambda: _scored_step(model, ids),
                                                                      args.repeats, device)}
    finally:
        K.set_tree_segments(before)
    base = rows["unpatched"]
    results = {name: {f"{part}_{key}": value for part, s in times.items()
                      for key, value in (("ms", round(s * 1e3, 2)), ("tokens_per_s", round(tokens / s, 1)),
                                         ("over_unpatched", round(base[part] / s, 3)))}
               for name, times in rows.items()}
    doc = dict(model=args.model, layers=args.layers or SHAPES[args.model]["num_layers"],
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", batch=args.batch,
               seq=args.seq, results=results)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
