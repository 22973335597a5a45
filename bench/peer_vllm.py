"""Throughput of stock vLLM, vLLM's batch-invariant mode and ours (through vLLM and native).

    python bench/peer_vllm.py [--model DIR] [--prompts 64] [--max-tokens 64] [--out FILE]

Same checkpoint, prompts and sampling settings for every system; each system runs in its own
subprocess (VLLM_BATCH_INVARIANT=1 must be set before vLLM starts); `--repeats N` runs the systems
round robin N times and reports each system's median run; `--timed-runs N` times N passes inside each
process and reports their median; `--interleave` runs stock vLLM, the plugin and the worker's `off` in
one process per round instead, their passes taken in turn. Without --model a tiny random
Qwen2 is saved to a temp dir, which is what runs on CPU (`--prompts 8 --max-tokens 16` for a quick
check). Prints (and with --out writes) one JSON object: generated tokens per second per system, plus
the acceptance rate of vLLM's proposals in verified mode. Systems that cannot run (e.g. the
batch-invariant mode where the backend lacks it) report their error instead of a number.

Systems (--systems, comma list):
- `vllm`, `vllm-batch-invariant`: stock vLLM (CUDA graphs, torch.compile) without and with
  VLLM_BATCH_INVARIANT=1; `vllm-eager`: stock vLLM without CUDA graphs; `vllm-v1`: stock vLLM on its
  V1 model runner (the one custom logits processors need);
- `vllm-plugin`: vLLM's own engine running the canonical forward (rollout_service.vllm.plugin) with
  the seeded Gumbel rule, on the model runner vLLM picks (V2 for dense models on GPU), decode steps
  from CUDA graphs; `vllm-plugin-eager`: the same without; `vllm-plugin-v1`: with graphs, on vLLM's
  V1 runner (the rule as a logits processor). At TP > 1, row-parallel outputs are
  combined by the plugin's default (on GPUs "tree_p2p": one kernel reads the peers' nodes from
  symmetric memory, kernels.symm_tree); `vllm-plugin-gather`: by the tree over NCCL's all-gather
  ("tree"); `vllm-plugin-scatter`: by the tree split by output columns (all-to-all, then an
  all-gather: kernels.tp);
- `native-verified`, `native-invariant`, `native-off`: our native engine (rollout_service.Engine);
- `ours-verified`, `ours-invariant`, `ours-off`: our engine with the windowed vLLM fast path;
- `worker-verified`, `worker-off`: VLLMEngine, the engine a RolloutWorker runs on a GPU (vLLM's engine
  loop stepped by the worker; `off` requests on its stock vLLM engine, given the memory share of the
  `vllm` system, whose core runs in this process, next to the canonical engine);
  `worker-off-own-process`: that stock engine's core in a process of its own (vLLM's default).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import emit
from bench.peer.engines import (
    LORA_SYSTEMS,
    add_engine_args,
    add_workload_args,
    default_checkpoint,
    on_cpu,
    save_random_adapter,
)
from bench.peer.passes import run_worker
from bench.peer.processes import process_results
from bench.peer.report import build_report
from bench.peer.systems import (
    ALL_SYSTEMS,
    DEFAULT_SYSTEMS,
    INTERLEAVABLE,
    INTERLEAVED_GPU_SHARE,
    interleaved_gpu_share,
)
from rollout_service.engine.decode_policy import VERIFIED_DECODE


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: a tiny random Qwen2 in a temp dir)")
    p.add_argument("--shape", help="instead of --model: random weights of a bench.rollout shape (qwen1.5b, llama8b)")
    p.add_argument("--num-layers", type=int, help="with --shape: fewer layers of the same shape")
    add_workload_args(p, prompt_len=32, max_tokens=64)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--verified-decode", default="auto", choices=VERIFIED_DECODE,
                   help="how our verified requests decode (dvr: always propose with vLLM and verify)")
    p.add_argument("--warmup-tokens", type=int, default=8,
                   help="an untimed run of the whole workload with this many output tokens first (JIT, caches)")
    add_engine_args(p)
    p.add_argument("--engine-core", default="in-process", choices=("in-process", "own-process"),
                   help="vllm* systems: vLLM's engine core in the benchmark's process, or in its own (vLLM's "
                        "default; the plugin then needs the package installed, for its entry point)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list of {ALL_SYSTEMS}")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the systems round robin this many times (each run its own process); a system's "
                        "tokens_per_s is then its median run, runs_tokens_per_s lists them in order, and "
                        "rounds_x_vllm each round's ratio to stock vLLM's run of that round")
    p.add_argument("--timed-runs", type=int, default=1,
                   help="timed passes over the workload inside each system's process (caches reset before "
                        "each); seconds is their median and timed_runs_s lists them")
    p.add_argument("--interleave", action="store_true",
                   help=f"run the systems ({', '.join(INTERLEAVABLE)}) in one process per round, each with its own "
                        "engine and memory share (--gpu-memory-utilization per engine), their timed passes taken in "
                        "turn: the process's host speed and the machine's drift then fall on each alike "
                        "(passes_x_vllm: each pass's ratio to stock's pass of the same turn)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help=f"systems {', '.join(LORA_SYSTEMS)}: every request runs one random rank-R adapter on every "
                        "projection (vLLM's enable_lora and LoRARequest; the plugin's sized before graph capture)")
    p.add_argument("--lora-dir", help=argparse.SUPPRESS)  # the adapter's PEFT checkpoint, written once by the parent
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--out")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    tmp = default_checkpoint(args, "peer-vllm-")
    if args.lora:
        lora_tmp = tempfile.TemporaryDirectory(prefix="peer-vllm-lora-")
        args.lora_dir = save_random_adapter(args.model, args.lora, lora_tmp.name)
    args.passthrough = _strip(argv, ("--out", "--systems", "--model", "--timeout", "--shape", "--num-layers",
                                             "--repeats"), flags=("--interleave",))
    args.passthrough += ["--model", args.model] + (["--lora-dir", args.lora_dir] if args.lora else [])
    systems = [s for s in args.systems.split(",") if s]
    if args.lora and set(systems) - set(LORA_SYSTEMS):
        p.error(f"--lora runs the systems {LORA_SYSTEMS}; got {systems}")
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {ALL_SYSTEMS}")
    if args.interleave and (set(systems) - set(INTERLEAVABLE) or args.tensor_parallel_size != 1):
        p.error(f"--interleave runs {INTERLEAVABLE} at TP = 1 (each with a process-wide setting of its own "
                f"otherwise); got {systems} at TP = {args.tensor_parallel_size}")
    asked = interleaved_gpu_share(systems, args.gpu_memory_utilization)
    if args.interleave and not on_cpu() and asked > INTERLEAVED_GPU_SHARE:
        p.error(f"--interleave: {systems} at --gpu-memory-utilization {args.gpu_memory_utilization} ask for "
                f"{asked:.2f} of the GPU together (worker-off "
                f"counts twice: its canonical engine is built too); lower it to "
                f"{INTERLEAVED_GPU_SHARE / interleaved_gpu_share(systems, 1.0):.2f} or less")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    model = args.model if tmp is None else f"{args.shape or 'tiny-qwen2'} (random weights)"
    processes = [systems] if args.interleave else [[system] for system in systems]
    for r in range(args.repeats):  # round robin: drift of the machine falls on every system alike
        for group in processes:
            for system, res in process_results(args, group).items():
                runs[system].append(res)
                print(f"{system}: {json.dumps(res)}", file=sys.stderr, flush=True)
            if args.out:  # each result as it comes: a run that is cut off still reports
                build_report(args, model, runs, args.out)
    emit(build_report(args, model, runs), args.out)
    if tmp is not None:
        tmp.cleanup()


def _strip(argv: list[str], names, flags=()) -> list[str]:
    """argv without the given options (both `--opt value` and `--opt=value`) and flags (no value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in names:
            skip = "=" not in a
            continue
        if a not in flags:
            out.append(a)
    return out


if __name__ == "__main__":
    main()
