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
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rollout_service.engine.decode_policy import VERIFIED_DECODE  # noqa: E402
from bench import emit  # noqa: E402

DEFAULT_SYSTEMS = ("vllm", "vllm-batch-invariant", "ours-verified")
ALL_SYSTEMS = DEFAULT_SYSTEMS + ("ours-invariant", "ours-off", "vllm-plugin", "vllm-plugin-eager", "vllm-plugin-v1",
                                 "vllm-plugin-gather", "vllm-plugin-scatter",
                                 "vllm-eager", "vllm-v1",
                                 "native-verified", "native-invariant", "native-off", "worker-verified", "worker-off",
                                 "worker-off-own-process")
# --interleave: these systems can share one process (no process-wide setting of their own, TP = 1)
INTERLEAVABLE = ("vllm", "vllm-eager", "vllm-plugin", "vllm-plugin-eager", "worker-off")
INTERLEAVED_GPU_SHARE = 0.9  # --interleave on a GPU: what the process's engines may ask for together
# the worker's off builds VLLMEngine's canonical engine beside the stock one that serves it, each with
# the vllm system's memory share
WORKER_OFF_ENGINES = 2
INTERLEAVED = "interleaved:"  # the worker name of an interleaved process, its systems after it
TEARDOWN_GRACE_S = 60  # a system's process gets this long to exit once it has printed its result
TINY_KW = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)  # head_dim 32


def _workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def _on_cpu() -> bool:
    import torch
    return not torch.cuda.is_available()


def _vllm_options(args) -> dict:
    opts = dict(max_model_len=args.prompt_len + args.max_tokens + 8)
    if _on_cpu():
        opts.update(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mib << 20)
    else:
        opts.update(gpu_memory_utilization=args.gpu_memory_utilization)
        if args.num_gpu_blocks:  # the same KV cache for every system, whatever profiling would leave it
            opts.update(num_gpu_blocks_override=args.num_gpu_blocks)
    return opts


def _kv_settings(args) -> dict:
    """What sized the engines' KV caches (a report's record of the workload)."""
    if _on_cpu():
        return dict(kv_cache_mib=args.kv_cache_mib)
    return dict(gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks=args.num_gpu_blocks)


def add_engine_args(p: argparse.ArgumentParser, gpu_memory_utilization: float = 0.4) -> None:
    """The options build_llm reads (KV cache size, TP degree): one definition for every tool that builds
    engines through it."""
    p.add_argument("--kv-cache-mib", type=int, default=512, help="vLLM KV cache on CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=gpu_memory_utilization,
                   help="vLLM's share of GPU memory (the verifier shares the GPU)")
    p.add_argument("--num-gpu-blocks", type=int,
                   help="GPU: every vLLM engine gets this many KV blocks (vLLM's num_gpu_blocks_override) "
                        "instead of what its memory profile leaves; compares speed at equal KV capacity")
    p.add_argument("--logprobs-layout", choices=("flat", "lists"), default="flat",
                   help="how the vllm* systems' outputs hold log-probs: vLLM's FlatLogprobs (flat_logprobs=True, "
                        "as the worker's engines ask) or vLLM's default dict per token, whose allocations set off "
                        "Python's garbage collector; the same for every vllm* system")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vllm* systems: vLLM's tensor parallelism over this many GPUs (the plugin's row-parallel "
                        "outputs combined by the segment tree, stock vLLM's by its all-reduce)")


def build_llm(args, system: str, max_num_seqs: int, own_process: bool = False):
    """The vllm.LLM of a `vllm*` system, its engine core in this process or its own (VLLM_BATCH_INVARIANT
    comes from the env). vllm-plugin*: the canonical model class and our seeded sampling rule."""
    if system == "vllm-v1":  # stock on the model runner the plugin uses (vLLM 0.25 defaults to V2)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    from vllm import LLM
    options = _vllm_options(args)
    if system == "vllm-eager":
        options["enforce_eager"] = True
    k = args.tensor_parallel_size
    if system.startswith("vllm-plugin"):
        from rollout_service.vllm.plugin import llm_options, register, require_entry_point
        register()  # in-process engine core: the entry point may not be installed
        if own_process:
            require_entry_point()  # vLLM's engine-core process builds the model
        options.update(llm_options(args.model, cuda_graphs=system != "vllm-plugin-eager" and not _on_cpu(),
                                   runner="v1" if system == "vllm-plugin-v1" else None, tensor_parallel_size=k))
        reduce = {"vllm-plugin-gather": "tree", "vllm-plugin-scatter": "tree_scatter"}.get(system)
        if reduce:  # TP > 1: the same tree, scheduled otherwise
            from rollout_service.vllm.plugin.tensor_parallel import TP_REDUCE_KEY
            options["additional_config"] = {TP_REDUCE_KEY: reduce}
    else:
        from rollout_service.vllm.plugin.tensor_parallel import tp_options
        options.update(tp_options(None, k))
    if not own_process:
        options.setdefault("distributed_executor_backend", "uni" if k == 1 else "mp")
    from rollout_service.vllm.plugin.compat import engine_core_placement
    with engine_core_placement(own_process):  # own process: the plugin is found through its entry point
        return LLM(model=args.model, dtype="bfloat16", skip_tokenizer_init=True, seed=args.seed,
                   max_num_seqs=max(max_num_seqs, 1), **options)


def request_params(args, system: str, prompts) -> list:
    """Per-request vLLM SamplingParams: the plugin's carry our rule's params (vLLM greedy over the
    one finite logit the rule leaves); stock ones sample with vLLM's sampler, seeded per request,
    returning the chosen token's log-prob with --stock-logprobs (as an RL rollout needs)."""
    from vllm import SamplingParams
    flat = args.logprobs_layout == "flat"
    if system.startswith("vllm-plugin"):
        from rollout_service.vllm.plugin.sampling import EXTRA_ARGS_KEY
        return [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False,
                               logprobs=0, flat_logprobs=flat, extra_args={EXTRA_ARGS_KEY: dict(
                                   seed=args.seed + i, temperature=args.temperature, top_k=-1, top_p=args.top_p,
                                   position=len(p))})
                for i, p in enumerate(prompts)]
    return [SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed + i,
                           max_tokens=args.max_tokens, ignore_eos=True, detokenize=False,
                           logprobs=0 if args.stock_logprobs else None, flat_logprobs=flat)
            for i in range(len(prompts))]


def engine_facts(llm) -> dict:
    """Which model runner and scheduling the engine ended up with (vLLM picks them per config), and
    its KV cache in tokens: what memory profiling left it, which caps how many sequences run at once."""
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    return dict(model_runner="v2" if getattr(config, "use_v2_model_runner", False) else "v1",
                async_scheduling=bool(config.scheduler_config.async_scheduling),
                kv_cache_tokens=(cache.num_gpu_blocks or 0) * cache.block_size)


@dataclasses.dataclass
class _Warmed:
    """A system's engine after its warm-up pass. generate() -> (seconds, outputs) runs the whole
    workload once (caches reset first, so every pass prefills); tokens(outputs) counts what it
    generated (raising if a rollout failed); close() frees the engine."""
    generate: Callable[[], tuple[float, list]]
    facts: dict  # what the report says of the engine (prefill time, runner, KV cache)
    tokens: Callable[[list], int]
    close: Callable[[], None] = lambda: None

    def result(self, timed: dict, outs) -> dict:
        res = dict(**timed, **self.facts, generated_tokens=self.tokens(outs))
        res["tokens_per_s"] = res["generated_tokens"] / res["seconds"]
        return res


def _warm_vllm(args, prompts, system: str) -> _Warmed:
    llm = build_llm(args, system, len(prompts), own_process=args.engine_core == "own-process")
    params = request_params(args, system, prompts)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def generate(max_tokens: int | None = None):
        llm.reset_prefix_cache()
        run_params = params if max_tokens is None else [_capped(p, max_tokens) for p in params]
        start = time.perf_counter()
        outs = llm.generate(inputs, run_params, use_tqdm=False)
        return time.perf_counter() - start, outs

    generate(args.warmup_tokens)  # every prefill shape of the workload (Triton compiles per shape)
    prefill_s, _ = generate(1)
    return _Warmed(generate, dict(prefill_seconds=round(prefill_s, 3), **engine_facts(llm)),
                   tokens=lambda outs: sum(len(o.outputs[0].token_ids) for o in outs))


def _warm_worker_engine(args, prompts, mode: str, stock_in_process: bool = True) -> _Warmed:
    """VLLMEngine, as a RolloutWorker runs it on a GPU. For `off` its stock engine and its canonical
    engine each get the vllm system's memory share."""
    from rollout_service import SamplingParams
    from rollout_service.vllm.engine import VLLMEngine
    options = _vllm_options(args)
    max_model_len = options.pop("max_model_len")
    options.pop("enforce_eager", None)  # VLLMEngine sets it (graphs on CUDA only)
    stock = mode == "off"
    share = min(0.9, options.pop("gpu_memory_utilization", 0.425) * (WORKER_OFF_ENGINES if stock else 1))
    engine = VLLMEngine(args.model, device="cpu" if _on_cpu() else "cuda", max_model_len=max_model_len,
                        max_num_seqs=len(prompts), stock_for_off=stock, gpu_memory_utilization=share,
                        stock_in_process=stock_in_process, stock_memory_share=1 / WORKER_OFF_ENGINES,
                        vllm_options=options)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                             seed=args.seed + i, determinism=mode) for i in range(len(prompts))]

    def generate():
        for path in (engine.canonical, engine.stock):  # prefill again, as the vllm systems do
            if path is not None:
                path.llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return time.perf_counter() - start, outs

    def tokens(outs) -> int:
        bad = [o.error for o in outs if not o.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} rollouts failed: {bad[0]}")
        return sum(len(o.token_ids) for o in outs)

    try:
        engine.generate(prompts, [dataclasses.replace(p, max_tokens=min(args.warmup_tokens, p.max_tokens))
                                  for p in params])
    except BaseException:
        engine.close()
        raise
    return _Warmed(generate, engine_facts((engine.stock if stock else engine.canonical).llm), tokens,
                   close=engine.close)


def _warm(args, prompts, system: str) -> _Warmed:
    if system.startswith("vllm"):
        return _warm_vllm(args, prompts, system)
    if system == "worker-off-own-process":
        return _warm_worker_engine(args, prompts, "off", stock_in_process=False)
    return _warm_worker_engine(args, prompts, system.split("-", 1)[1])


def _run_warmed(args, prompts, system: str) -> dict:
    warmed = _warm(args, prompts, system)
    try:
        timed, outs = _timed_runs(args, warmed.generate)
        return warmed.result(timed, outs)
    finally:
        warmed.close()


def _run_interleaved(args, prompts, systems: list[str]) -> dict:
    """Every system's engine in this one process, their timed passes taken in turn (pass t starts with
    system t mod n): the process's host speed and the machine's drift fall on each system alike, where
    separate processes each draw their own. Returns each system's result, with each pass's ratio to
    stock vLLM's pass of the same turn (`passes_x_vllm`), their median, and the ratio of all the passes'
    times (`x_vllm_all_passes`)."""
    engines: dict[str, _Warmed] = {}
    try:
        for system in systems:
            engines[system] = _warm(args, prompts, system)
        times: dict[str, list[float]] = {system: [] for system in systems}
        outs = {}
        for t in range(args.timed_runs):
            for system in systems[t % len(systems):] + systems[:t % len(systems)]:
                elapsed, outs[system] = engines[system].generate()
                times[system].append(elapsed)
        results = {system: engines[system].result(_pass_times(times[system]), outs[system]) for system in systems}
    finally:
        for warmed in engines.values():
            warmed.close()
    if "vllm" in times:
        for system, res in results.items():
            ratios = [b / x for x, b in zip(times[system], times["vllm"])]
            res.update(passes_x_vllm=[round(r, 3) for r in ratios], x_vllm_passes_median=round(_median(ratios), 3),
                       x_vllm_all_passes=round(sum(times["vllm"]) / sum(times[system]), 3))
    return results


def _pass_times(times: list[float]) -> dict:
    """The timed passes of one process: the median pass's seconds and every pass's. Passes are kept to
    0.1 ms: a tiny model's pass takes a few ms, where rounding to the ms would move a ratio by 10%."""
    return dict(seconds=sorted(times)[len(times) // 2], timed_runs_s=[round(t, 4) for t in times])


def _timed_runs(args, run) -> tuple[dict, list]:
    """run() -> (seconds, outputs), --timed-runs times in this process: the median's seconds, every
    run's seconds, and the last run's outputs."""
    times, outs = [], None
    for _ in range(args.timed_runs):
        elapsed, outs = run()
        times.append(elapsed)
    return _pass_times(times), outs


def _capped(params, max_tokens: int):
    capped = params.clone()
    capped.max_tokens = min(max_tokens, params.max_tokens)
    return capped


def _run_ours(args, prompts, mode, fast_path) -> dict:
    from rollout_service import Engine, SamplingParams
    device = "cpu" if _on_cpu() else "cuda"
    engine = Engine(args.model, fast_path=fast_path, window=args.window, group=args.group, device=device,
                    max_model_len=args.prompt_len + args.max_tokens + 8,
                    kv_cache_tokens=len(prompts) * (args.prompt_len + args.max_tokens + 32),
                    max_num_seqs=len(prompts), fast_path_options=_vllm_options(args) if fast_path == "vllm" else None,
                    verified_decode=args.verified_decode)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                             seed=args.seed + i, determinism=mode) for i in range(len(prompts))]
    engine.generate(prompts, [dataclasses.replace(p, max_tokens=min(args.warmup_tokens, p.max_tokens))
                              for p in params])  # warm-up: every prefill shape of the workload

    def run():
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return time.perf_counter() - start, outs
    timed, outs = _timed_runs(args, run)
    bad = [o.error for o in outs if not o.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} rollouts failed: {bad[0]}")
    proposed = sum(o.stats.proposed_tokens for o in outs)
    res = dict(**timed, generated_tokens=sum(len(o.token_ids) for o in outs))
    if mode == "verified":
        res.update(acceptance=sum(o.stats.accepted_tokens for o in outs) / max(proposed, 1),
                   rollbacks=sum(o.stats.rollbacks for o in outs),
                   verify_windows=sum(o.stats.verify_windows for o in outs))
    return res


def _worker(args) -> None:
    import faulthandler
    import transformers
    if args.timeout > 60:  # a hang shows where it waits, 30 s before the kill (a dump during start-up can crash)
        faulthandler.dump_traceback_later(args.timeout - 30, exit=False)
    vocab = transformers.AutoConfig.from_pretrained(args.model).vocab_size
    prompts = _workload(args, vocab)
    system = args.worker
    try:
        if system.startswith(INTERLEAVED):
            print("RESULT " + json.dumps(_run_interleaved(args, prompts, system[len(INTERLEAVED):].split(","))),
                  flush=True)
            return
        if system.startswith(("vllm", "worker-")):
            res = _run_warmed(args, prompts, system)
        else:
            engine, mode = system.split("-", 1)
            res = _run_ours(args, prompts, mode, "native" if engine == "native" else "vllm")
            res["tokens_per_s"] = res["generated_tokens"] / res["seconds"]
    except Exception as err:  # reported, not raised: the other systems still run
        res = dict(error=f"{type(err).__name__}: {err}"[:500])
    print("RESULT " + json.dumps(res), flush=True)


def _child(args, system: str) -> dict:
    """One system in its own process group, which is killed when the system ends (vLLM's engine-core
    and worker processes must not outlive it: the next system's memory profiling would see their memory
    come back). With --out, the process's output is kept in `<out>.<system>.log`; a failed system's
    result names the error lines of that output (vLLM's "see root cause above"). A process that has
    printed its result but not exited within TEARDOWN_GRACE_S is killed: its figures stand, and its
    result's `teardown` says so."""
    env = dict(os.environ)
    env.pop("VLLM_BATCH_INVARIANT", None)
    if system == "vllm-batch-invariant":
        env["VLLM_BATCH_INVARIANT"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--timeout", str(args.timeout)]
    cmd += args.passthrough
    start = time.perf_counter()
    output, stopped, returncode = supervise(cmd, env, args.timeout)
    wall = round(time.perf_counter() - start, 1)
    if args.out:
        name = "interleaved" if system.startswith(INTERLEAVED) else system
        with open(f"{os.path.splitext(args.out)[0]}.{name}.log", "w") as f:
            f.write(output)
    result = next((json.loads(line[len("RESULT "):]) for line in output.splitlines()
                   if line.startswith("RESULT ")), None)
    if result is None:
        result = dict(error=stopped or f"exit {returncode}")
    elif stopped:  # measured, then stuck in teardown: the figures stand, the hang is reported
        result["teardown"] = stopped
    if "error" in result:
        result["causes"] = error_lines(output)
    result["process_wall_s"] = wall
    return result


def _process_results(args, group: list[str]) -> dict[str, dict]:
    """Each system's result from one process: a system's own, or a group's under --interleave (a
    process that failed gives each system its error)."""
    if not args.interleave:
        return {group[0]: _child(args, group[0])}
    res = _child(args, INTERLEAVED + ",".join(group))
    return {system: dict(res[system], process_wall_s=res["process_wall_s"]) if system in res else res
            for system in group}


def supervise(cmd: list[str], env: dict, timeout: float, grace: float = TEARDOWN_GRACE_S):
    """Runs cmd in a process group of its own and kills the group when it ends, at `timeout`, or
    `grace` seconds after a RESULT line (a process stuck in teardown after measuring). Returns
    (output, why it was stopped or None, exit code or None)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, result_at = [], []

    def read():  # vLLM's processes may keep the pipe open after the worker: read in a thread
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("RESULT ") and not result_at:
                result_at.append(time.perf_counter())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stopped = None
    while proc.poll() is None:
        now = time.perf_counter()
        if now - start > timeout:
            stopped = f"timed out after {timeout} s"
            break
        if result_at and now - result_at[0] > grace:
            stopped = f"killed {grace} s after its result: the process had not exited"
            break
        time.sleep(0.2)
    _kill_group(proc.pid)
    reader.join(timeout=30)
    return "".join(lines), stopped, proc.poll()


def error_lines(output: str, keep: int = 6) -> list[str]:
    """The last distinct lines of a process's output that name an error (exception lines, vLLM's
    ERROR log records), oldest first."""
    marks = ("Error", "Exception", "ERROR", "Timeout", "Killed")
    seen, picked = set(), []
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("RESULT ") or line in seen or not any(m in line for m in marks):
            continue
        seen.add(line)
        picked.append(line[:400])
        if len(picked) == keep:
            break
    return picked[::-1]


def _kill_group(pgid: int) -> None:
    import signal
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: a tiny random Qwen2 in a temp dir)")
    p.add_argument("--shape", help="instead of --model: random weights of a bench.rollout shape (qwen1.5b, llama8b)")
    p.add_argument("--num-layers", type=int, help="with --shape: fewer layers of the same shape")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--stock-logprobs", action="store_true",
                   help="stock systems also return each token's log-prob (logprobs=0), as ours always do")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--verified-decode", default="auto", choices=VERIFIED_DECODE,
                   help="how our verified requests decode (dvr: always propose with vLLM and verify)")
    p.add_argument("--seed", type=int, default=0)
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
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--out")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    tmp = None
    if not args.model:
        tmp = tempfile.TemporaryDirectory(prefix="peer-vllm-")
        if args.shape:
            from bench.rollout import save_model
            save_model(args.shape, tmp.name, args.num_layers)
        else:
            from rollout_service.tiny_models import tiny_model
            tiny_model("qwen2", seed=0, **TINY_KW).save_pretrained(tmp.name)
        args.model = tmp.name
    args.passthrough = _strip(argv, ("--out", "--systems", "--model", "--timeout", "--shape", "--num-layers",
                                             "--repeats"), flags=("--interleave",))
    args.passthrough += ["--model", args.model]
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {ALL_SYSTEMS}")
    if args.interleave and (set(systems) - set(INTERLEAVABLE) or args.tensor_parallel_size != 1):
        p.error(f"--interleave runs {INTERLEAVABLE} at TP = 1 (each with a process-wide setting of its own "
                f"otherwise); got {systems} at TP = {args.tensor_parallel_size}")
    asked = interleaved_gpu_share(systems, args.gpu_memory_utilization)
    if args.interleave and not _on_cpu() and asked > INTERLEAVED_GPU_SHARE:
        p.error(f"--interleave: {systems} at --gpu-memory-utilization {args.gpu_memory_utilization} ask for "
                f"{asked:.2f} of the GPU together (worker-off "
                f"counts twice: its canonical engine is built too); lower it to "
                f"{INTERLEAVED_GPU_SHARE / interleaved_gpu_share(systems, 1.0):.2f} or less")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    model = args.model if tmp is None else f"{args.shape or 'tiny-qwen2'} (random weights)"
    processes = [systems] if args.interleave else [[system] for system in systems]
    for r in range(args.repeats):  # round robin: drift of the machine falls on every system alike
        for group in processes:
            for system, res in _process_results(args, group).items():
                runs[system].append(res)
                print(f"{system}: {json.dumps(res)}", file=sys.stderr, flush=True)
            if args.out:  # each result as it comes: a run that is cut off still reports
                _report(args, model, runs, args.out)
    emit(_report(args, model, runs), args.out)
    if tmp is not None:
        tmp.cleanup()


def interleaved_gpu_share(systems: list[str], share: float) -> float:
    """The GPU memory share an interleaved process's engines ask for together: `share` per engine,
    and worker-off builds two (VLLMEngine's canonical engine beside the stock one it serves off on)."""
    return share * sum(WORKER_OFF_ENGINES if system == "worker-off" else 1 for system in systems)


def _report(args, model: str, runs: dict[str, list[dict]], partial_out: str | None = None) -> dict:
    """The report of the runs so far; with partial_out, also written there as JSON (not printed)."""
    results = {system: _median_run(rs) for system, rs in runs.items() if rs}
    for base in ("vllm", "vllm-batch-invariant"):  # ratios inside this one run
        base_tps = results.get(base, {}).get("tokens_per_s")
        for system, res in results.items():
            if base_tps and "tokens_per_s" in res:
                res[f"x_{base.replace('-', '_')}"] = round(res["tokens_per_s"] / base_tps, 3)
            if base == "vllm" and len(runs[system]) > 1 and base in runs:
                res.update(_paired_ratios(runs[system], runs[base]))
    import torch
    report = dict(
        benchmark="peer_vllm", device="cpu" if _on_cpu() else torch.cuda.get_device_name(), model=model,
        tensor_parallel_size=args.tensor_parallel_size, engine_core=args.engine_core, interleaved=args.interleave,
        workload=dict(prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                      stock_logprobs=args.stock_logprobs, logprobs_layout=args.logprobs_layout,
                      temperature=args.temperature, top_p=args.top_p, **_kv_settings(args)),
        ours=dict(window=args.window, group=args.group), results=results)
    if partial_out:
        report["complete"] = False
        with open(partial_out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _median_run(runs: list[dict]) -> dict:
    """One system's runs as one result: the median run by tokens/s (the first error if none ran),
    with every run's tokens/s in order when there were several."""
    ok = sorted((r for r in runs if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
    if not ok:
        return runs[0]
    out = dict(ok[(len(ok) - 1) // 2])
    if len(runs) > 1:
        out["runs_tokens_per_s"] = [round(r.get("tokens_per_s", float("nan")), 1) for r in runs]
    return out


def _paired_ratios(runs: list[dict], base_runs: list[dict]) -> dict:
    """Each round's ratio to stock vLLM's run of the same round (the machine's drift between rounds
    falls out), and their median; a round where either run failed has none."""
    ratios = [round(r["tokens_per_s"] / b["tokens_per_s"], 3) for r, b in zip(runs, base_runs)
              if "tokens_per_s" in r and "tokens_per_s" in b]
    if not ratios:
        return {}
    return dict(rounds_x_vllm=ratios, x_vllm_rounds_median=round(_median(ratios), 3))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


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
