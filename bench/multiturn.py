"""Multi-turn rollout throughput: the vLLM plugin against stock vLLM on the same episodes.

    python -m bench.multiturn --shape qwen1.5b [--turns 8] [--episodes 64] [--systems vllm-plugin,vllm] [--rounds 3]

Each episode is a random prompt of --prompt-len tokens, then --turns model turns of --max-tokens tokens
each (no stop token, so every turn runs its length and every system does the same work), with an
observation of --observation-len tokens from a synthetic environment after each turn but the last. The
episodes run through recipes.episodes.run_episodes: a turn's request is the episode's whole context and every
live episode's turn goes in one generate call, so later turns' prefill can come from the prefix cache.

Every system's engine is built in this one process and its timed passes are taken in turns (round r starts
with system r mod n), so the machine's drift falls on each alike; each pass starts from an empty prefix
cache, after --warmup-passes untimed passes. Without --model or --shape a tiny random Qwen2 is saved to a
temp dir (what runs on CPU). Progress goes to stderr; one JSON document to stdout (and --out).

Systems (--systems, comma list):
- `vllm-plugin`: vLLM running the canonical forward with our seeded rule (bench.peer_vllm's vllm-plugin);
- `vllm`: stock vLLM (its model class and sampler, returning each token's log-prob as an RL rollout needs;
  --no-stock-logprobs: none);
- `worker-verified`: VLLMEngine, the engine a pool's vLLM worker runs (prompts salted per weights).

Per system: tokens_per_s (model tokens / wall seconds of the median pass) and every pass's; the model,
observation and prompt tokens; the prefill split of the median pass (prompt tokens computed, and taken from
the prefix cache: RequestOutput.num_cached_tokens, rollout_service.vllm.prefix_cache) against its decode
tokens, with the hit rate overall, over the later turns and per turn; each turn's seconds. The time itself is
not split into prefill and decode: under chunked prefill one vLLM step runs both. `ratios` pairs each
system's pass with stock vLLM's pass of the same round (its tokens/s over stock's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

# vLLM logs to stdout unless told otherwise; stdout is this benchmark's JSON
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import emit
from bench.multiturn_engines import DEFAULT_SYSTEMS, SYSTEMS, build
from bench.multiturn_episodes import Pass, max_model_len, prompts, run_pass
from bench.peer.engines import add_engine_args, default_checkpoint, kv_settings, on_cpu
from bench.peer.systems import INTERLEAVED_GPU_SHARE

STOCK = "vllm"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: --shape's random weights, else a tiny random Qwen2)")
    p.add_argument("--shape", help="random weights of a bench.rollout shape (qwen1.5b: Qwen2.5-1.5B shapes)")
    p.add_argument("--num-layers", type=int, help="with --shape: fewer layers of the same shape")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per model turn")
    p.add_argument("--observation-len", type=int, default=64, help="tokens of each observation")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list of {SYSTEMS}")
    p.add_argument("--rounds", type=int, default=3, help="timed passes per system, taken in turns")
    p.add_argument("--warmup-passes", type=int, default=1, help="untimed passes per system first (graphs, JIT)")
    p.add_argument("--no-stock-logprobs", action="store_true", help="stock vLLM returns no log-probs")
    p.add_argument("--block-size", type=int, help="vLLM's KV block size for every system (default: vLLM's on GPU, "
                                                   "32 on CPU); the prefix cache reuses whole blocks")
    p.add_argument("--out")
    add_engine_args(p)
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown or not args.systems:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if not on_cpu() and args.gpu_memory_utilization * len(args.systems) > INTERLEAVED_GPU_SHARE:
        p.error(f"{len(args.systems)} engines at --gpu-memory-utilization {args.gpu_memory_utilization} ask for more "
                f"than {INTERLEAVED_GPU_SHARE} of the GPU together; lower it")
    if min(args.turns, args.episodes, args.rounds, args.max_tokens) < 1:
        p.error("--turns, --episodes, --rounds and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    args.label = args.model or f"{args.shape or 'tiny-qwen2'} (random weights)"
    tmp = default_checkpoint(args, "multiturn-")
    try:
        return _run(args)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(args) -> dict:
    import transformers
    import vllm
    vocab = transformers.AutoConfig.from_pretrained(args.model).vocab_size
    rows = prompts(args.episodes, args.prompt_len, vocab, args.seed)
    report = dict(bench="multiturn", model=args.label,
                  device="cpu" if on_cpu() else _gpu_name(), vllm=vllm.__version__, episodes=args.episodes,
                  turns=args.turns, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                  observation_len=args.observation_len, temperature=args.temperature, top_p=args.top_p,
                  rounds=args.rounds, warmup_passes=args.warmup_passes, stock_logprobs=not args.no_stock_logprobs,
                  **kv_settings(args), systems=args.systems)
    systems, passes, errors = {}, {s: [] for s in args.systems}, {}

    def failed(name: str, e: Exception) -> None:  # reported, not raised: the other systems still run
        errors[name] = f"{type(e).__name__}: {e}"[:500]
        _say(f"{name}: {errors[name]}")

    try:
        for name in args.systems:
            _say(f"{name}: building and warming up")
            try:
                systems[name] = build(args, name, max_model_len(args))
                for _ in range(args.warmup_passes):
                    systems[name].reset()
                    run_pass(systems[name].generate, rows, args, vocab)
            except Exception as e:
                failed(name, e)
        for r in range(args.rounds):
            for name in _in_turn([s for s in args.systems if s in systems and s not in errors], r):
                systems[name].reset()
                try:
                    done = run_pass(systems[name].generate, rows, args, vocab)
                except Exception as e:
                    failed(name, e)
                    continue
                passes[name].append(done)
                _say(f"round {r} {name}: {done.model_tokens / done.seconds:.1f} model tok/s ({done.seconds:.2f} s), "
                     f"prefix-cache hit rate {_rate(sum(done.turn_cached_tokens), sum(done.turn_prompt_tokens)):.3f}")
            report.update(results=_results(passes, errors, systems), ratios=_ratios(passes))
            if args.out:  # each round as it comes: a run that is cut off still reports
                _write(report, args.out)
        report.update(results=_results(passes, errors, systems), ratios=_ratios(passes))
        emit(report, args.out)
    finally:
        for system in systems.values():
            system.close()
    return report


def _in_turn(names: list[str], r: int) -> list[str]:
    """Round r's order: it starts with system r mod n, so each system comes first as often as the others."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def _results(passes: dict[str, list[Pass]], errors: dict, systems: dict) -> dict:
    """Each system's summary, with its error where one stopped it (after some passes: both)."""
    out = {}
    for name, done in passes.items():
        if done:
            out[name] = dict(_summary(done), engine=systems[name].facts)
        if name in errors:
            out.setdefault(name, {})["error"] = errors[name]
    return out


def _summary(done: list[Pass]) -> dict:
    """A system's passes: the median pass's figures, and every pass's tokens/s and seconds."""
    median = sorted(done, key=lambda p: p.seconds)[len(done) // 2]
    prompt, cached = sum(median.turn_prompt_tokens), sum(median.turn_cached_tokens)
    return {"tokens_per_s": median.model_tokens / median.seconds, "seconds": median.seconds,
            "passes_tokens_per_s": [p.model_tokens / p.seconds for p in done],
            "passes_s": [p.seconds for p in done],  # unrounded: the ratios are computed from these
            "model_tokens": median.model_tokens, "observation_tokens": median.observation_tokens,
            "turns_run": median.turns_run,
            "prefill": {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached},
            "decode_tokens": median.model_tokens,
            "prefix_cache": {"hit_rate": _rate(cached, prompt),
                             "later_turns_hit_rate": _rate(sum(median.turn_cached_tokens[1:]),
                                                           sum(median.turn_prompt_tokens[1:])),
                             "turn_hit_rate": [_rate(c, q) for c, q in zip(median.turn_cached_tokens,
                                                                            median.turn_prompt_tokens)]},
            "turn_seconds": [round(s, 4) for s in median.turn_seconds]}


def _ratios(passes: dict[str, list[Pass]]) -> dict:
    """Each system's tokens/s over stock vLLM's, pass by pass (the passes of one round in turn), their median,
    and over all passes (stock's seconds over the system's: every pass has the same model tokens)."""
    stock = passes.get(STOCK) or []
    out = {}
    for name, done in passes.items():
        if name == STOCK or not done or not stock:
            continue
        pairs = [(p.model_tokens / p.seconds) / (b.model_tokens / b.seconds) for p, b in zip(done, stock)]
        out[f"{name}/{STOCK}"] = {"passes": pairs, "median": statistics.median(pairs),
                                  "all_passes": sum(b.seconds for b in stock[:len(pairs)]) /
                                  sum(p.seconds for p in done[:len(pairs)])}
    return out


def _rate(cached: int, prompt: int) -> float:
    return cached / prompt if prompt else 0.0


def _write(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(report, indent=1) + "\n")


def _gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
