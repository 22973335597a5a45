"""What a weight switch in flight costs the native engine: the running requests' prompt and generated
tokens prefilled again under the new weights (switch_modes.SWITCH_IN_FLIGHT) against the decode steps
that time would have bought; prints JSON.

    python -m bench.switch_cost --model qwen1.5b --batch 64 --prompt 256 --generated 128,512

For each generated length G: `batch` requests run until each has G tokens; then, in turns (rounds),
the time for every request to gain one token without a switch (a decode step) and with one
(update_weights, then the step that prefills every request again and gives its next token; the load
alone is `of_which_load_s`, which a drain pays too). `recompute_over_decode` is
how many decode steps the switch costs; finish-then-switch instead waits for the longest request to
finish, so a switch in flight is the cheaper one while fewer tokens than that remain.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.rollout import SHAPES, build_model
from rollout_service import Engine, SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _until_each_gains_one(engine: Engine) -> float:
    """Seconds until every running request has one more generated token."""
    running = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    target = {id(r): r.num_generated + 1 for r in running}
    start = time.perf_counter()
    while any(r.num_generated < target[id(r)] for r in running):
        engine.step()
    _sync(engine.device)
    return time.perf_counter() - start


def measure(engine: Engine, weights: list[dict], batch: int, prompt: int, generated: int, rounds: int,
            seed: int) -> dict:
    vocab = engine.spec.vocab_size
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        engine.add_request(ids, SamplingParams(max_tokens=generated + 4 * rounds + 8, temperature=1.0, seed=i,
                                               determinism="invariant"))
    while min((r.num_generated for r in engine.scheduler.running), default=0) < generated or engine.scheduler.waiting:
        engine.step()
    decode, switch, loads = [], [], []
    for r in range(rounds):  # in turns: a machine that slows down slows both
        decode.append(_until_each_gains_one(engine))
        start = time.perf_counter()
        engine.update_weights(weights[r % 2])
        _sync(engine.device)
        load = time.perf_counter() - start
        loads.append(load)
        switch.append(load + _until_each_gains_one(engine))
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()
    d, s = statistics.median(decode), statistics.median(switch)
    return {"generated": generated, "recomputed_tokens": batch * (prompt + generated), "decode_step_s": round(d, 5),
            "switch_step_s": round(s, 5), "of_which_load_s": round(statistics.median(loads), 5),
            "recompute_over_decode": round(s / d, 2),
            "pairs": [round(b / a, 2) for a, b in zip(decode, switch)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--generated", default="32,128", help="generated tokens at the switch, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kv-cache-tokens", type=int, default=0, help="0: enough for the largest case")
    args = ap.parse_args()
    lengths = [int(x) for x in args.generated.split(",")]
    model = build_model(args.model, args.device)
    weights = [{k: v.clone() for k, v in model.state_dict().items()}]
    with torch.no_grad():  # a second version: every weight nudged
        weights.append({k: (v.float() * 1.01).to(v.dtype) for k, v in weights[0].items()})
    longest = args.prompt + max(lengths) + 4 * args.rounds + 16
    # window 1: every decode step commits one token per request, as the step after a switch does
    engine = Engine(model, device=args.device, copy_model=False, window=1, max_num_seqs=max(args.batch, 1),
                    max_model_len=longest, kv_cache_tokens=args.kv_cache_tokens or args.batch * longest + 1024)
    results = [measure(engine, weights, args.batch, args.prompt, n, args.rounds, seed=n) for n in lengths]
    device = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
    print(json.dumps({"benchmark": "switch_cost", "model": args.model, "device": device, "batch": args.batch,
                      "prompt": args.prompt, "rounds": args.rounds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
