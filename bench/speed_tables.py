"""The plugin-against-stock speed tables (docs/performance.md), one name each: the one home of their workloads and systems.

    python -m bench.speed_tables --list
    python -m bench.speed_tables qwen1.5b-64 --out qwen1.5b_64.json
    python -m bench.speed_tables llama8b-256 --systems vllm,vllm-plugin --out part.json

Each table is one run of bench.peer_vllm: every system in its own process on the same checkpoint
(random weights of the table's shape) and the same prompts, with ratios to stock vLLM and to
VLLM_BATCH_INVARIANT=1 taken inside that run. Options after the table's name go to bench.peer_vllm
and win over the table's own (argparse keeps the last value), e.g. fewer `--systems`, or `--model DIR
--prompts 2` (a checkpoint instead of the table's shape) for a quick check on CPU. `--dry-run` prints
the bench.peer_vllm arguments only.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

# stock vLLM, its batch-invariant mode, ours through vLLM (the plugin, and the worker's engine serving
# verified and off) and ours native: every system the tables compare
ROLLOUT_SYSTEMS = ("vllm", "vllm-batch-invariant", "vllm-plugin", "worker-verified", "worker-off", "native-verified")


@dataclass(frozen=True)
class Table:
    shape: str  # a bench.rollout shape, random weights
    prompts: int
    prompt_len: int
    max_tokens: int
    systems: tuple[str, ...] = ROLLOUT_SYSTEMS
    timed_runs: int = 3  # timed passes per system process; the report holds their median
    # round-robin rounds (a process per system each): Qwen2.5-1.5B's steps are short, so a process's
    # host speed moves its figure; each round's ratio to stock is reported too
    repeats: int = 1
    tensor_parallel_size: int = 1
    # one process per round, the systems' passes taken in turn (bench.peer_vllm --interleave)
    interleave: bool = False
    gpu_memory_utilization: float | None = None  # each engine's share of the GPU; None: bench.peer_vllm's default
    # KV blocks for every engine (None: what profiling leaves), so that GPUs of any memory size
    # run the same schedule, preemptions included
    num_gpu_blocks: int | None = None
    timeout_s: int = 1200  # per system process: a hang costs this, not the whole run
    about: str = ""

    def peer_args(self) -> list[str]:
        """bench.peer_vllm's arguments for this table (T = 1, log-probs returned by every system)."""
        return ["--shape", self.shape, "--prompts", str(self.prompts), "--prompt-len", str(self.prompt_len),
                "--max-tokens", str(self.max_tokens), "--stock-logprobs", "--systems", ",".join(self.systems),
                "--timed-runs", str(self.timed_runs), "--repeats", str(self.repeats),
                "--tensor-parallel-size", str(self.tensor_parallel_size),
                "--timeout", str(self.timeout_s)] + (["--interleave"] if self.interleave else []) + [
                    arg for flag, value in (("--gpu-memory-utilization", self.gpu_memory_utilization),
                                            ("--num-gpu-blocks", self.num_gpu_blocks))
                    if value is not None for arg in (flag, str(value))]


def _tables() -> dict[str, Table]:
    tables = {}
    for shape in ("qwen1.5b", "llama8b"):
        rounds = 2 if shape == "qwen1.5b" else 1  # Llama-3.1-8B's passes are GPU-bound: one round suffices
        tables[f"{shape}-64"] = Table(shape, 64, 512, 512, timed_runs=5, repeats=rounds,
                                      about="batch: 64 prompts x 512 in / 512 out")
        tables[f"{shape}-256"] = Table(shape, 256, 512, 512, repeats=rounds, about="batch: 256 prompts x 512 in / 512 out")
        tables[f"{shape}-long"] = Table(shape, 32, 1024, 8192, timed_runs=1, timeout_s=3600,
                                        about="long reasoning rollouts: 32 prompts x 1,024 in / 8,192 out")
        # the host-bound Qwen2.5-1.5B tables, stock vLLM, the plugin and the worker's off in one
        # process: four engines at 0.22 of the GPU each still hold the whole batch
        if shape == "qwen1.5b":
            for prompts, passes in ((64, 5), (256, 3)):
                tables[f"{shape}-{prompts}-interleaved"] = Table(
                    shape, prompts, 512, 512, systems=("vllm", "vllm-plugin", "worker-off"), timed_runs=passes,
                    repeats=rounds, interleave=True, gpu_memory_utilization=0.22,
                    about=f"batch: {prompts} prompts x 512 in / 512 out, the systems' passes taken in turn "
                          "in one process")
    # Llama-3.1-8B at 256 prompts with an H100's cache at a 0.4 share (7,600 blocks of 16, 121,600
    # tokens), where decode steps run 65-255 sequences and preempted ones are recomputed: stock vLLM
    # and the plugin taking turns, an H200 running the same schedule
    tables["llama8b-256-interleaved"] = Table(
        "llama8b", 256, 512, 512, systems=("vllm", "vllm-plugin"), timed_runs=5, interleave=True,
        gpu_memory_utilization=0.4, num_gpu_blocks=7600,
        about="batch: 256 prompts x 512 in / 512 out, an H100's KV cache, the passes taken in turn in one process")
    tables["worker-off-placement"] = Table(
        "qwen1.5b", 256, 512, 256, systems=("vllm", "worker-off", "worker-off-own-process"), repeats=2,
        about="off through the worker: its stock engine's core in this process against one of its own")
    for k in (2, 4, 8):
        tables[f"llama8b-tp{k}"] = Table(
            "llama8b", 256, 512, 512, systems=("vllm", "vllm-plugin", "vllm-plugin-gather", "vllm-plugin-scatter"),
            tensor_parallel_size=k,
            about=f"TP = {k} on {k} GPUs: the plugin's segment tree (read from the peers' memory, the default; "
                  "all-gathered; split by columns) against stock vLLM's all-reduce")
    return tables


TABLES = _tables()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", nargs="?", choices=sorted(TABLES), metavar="TABLE", help="one of --list")
    p.add_argument("--list", action="store_true", help="print the tables and their settings as JSON")
    p.add_argument("--dry-run", action="store_true", help="print the bench.peer_vllm arguments, run nothing")
    args, peer_overrides = p.parse_known_args(argv)
    if args.list:
        print(json.dumps({name: dict(about=t.about, peer_vllm=t.peer_args()) for name, t in TABLES.items()},
                         indent=1))
        return
    if args.table is None:
        p.error("name a table (see --list)")
    peer_args = TABLES[args.table].peer_args() + peer_overrides
    if args.dry_run:
        print(json.dumps(peer_args))
        return
    from bench import peer_vllm
    peer_vllm.main(peer_args)


if __name__ == "__main__":
    main(sys.argv[1:])
