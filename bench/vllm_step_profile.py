"""Where a vLLM system's generate time goes on the host: device syncs (with the Python stack that
issued each) and the functions that take the most host time.

    python -m bench.vllm_step_profile --shape qwen1.5b --system vllm-plugin --prompts 64 \
        --prompt-len 512 --max-tokens 128

One system per process (as bench.peer_vllm runs them). Prints one JSON object: tokens/s of a plain
timed generate, the engine's model runner / async scheduling, the distinct synchronising call sites
(torch's sync debug mode) with their counts per generated step, and cProfile's top functions by own
time. `--kernels`: instead, the GPU kernels of one generate by total device time (torch.profiler;
kernels replayed from CUDA graphs are listed where CUPTI traces them, else use --system *-eager).
`--host-times`: instead, host time per engine step in the engine's own functions (scheduler,
model runner, sampler, output processing; timed by wrapping them), and the time spent waiting for
the GPU's results, without a profiler's overhead; with the decode steps counted by batch size (the
products' M) and the steps that carry prefill chunks.
`--timeline`: instead, how busy the GPU is during one generate, its idle gaps and the CUDA runtime
calls, the longest gaps with the host ops that overlap them, and the host's garbage collections and
Triton compilations; with `--stacks`, also which host Python functions run while it idles
(torch.profiler's trace).
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import contextlib
import io
import os
import pstats
import sys
import tempfile
import time
import traceback
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import emit  # noqa: E402
from bench.peer.engines import add_engine_args, build_llm, capped, engine_facts, request_params, workload  # noqa: E402


def _sync_sites(run) -> collections.Counter:
    """Distinct Python stacks (innermost frames) of synchronising torch calls made during run()."""
    import torch
    sites: collections.Counter = collections.Counter()
    if not torch.cuda.is_available():  # the sync debug mode exists for CUDA only
        run()
        return sites
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename][-4:]
        sites[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames))] += 1

    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    return sites


def _import_relative(text: str) -> str:
    """Source paths as seen from the import path (vllm/v1/..., rollout_service/...): the report names
    modules, not where this machine installed them."""
    roots = {r for p in sys.path if p and os.path.isdir(p) for r in (p.rstrip(os.sep), os.path.normpath(p))}
    for root in sorted(roots, key=len, reverse=True):
        text = text.replace(root + os.sep, "")
    return text


def _kernel_table(run, top: int) -> tuple[list[dict], float]:
    """The `top` GPU kernels of run() by total device time (on CPU: torch ops by own CPU time): name,
    calls, total and mean microseconds, share; and the total over all kernels, listed or not (compare
    systems by that, not by sums over their top lists)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()

    def own_us(e):
        return e.self_device_time_total if cuda else e.self_cpu_time_total
    events = sorted((e for e in prof.key_averages() if own_us(e) > 0), key=own_us, reverse=True)
    total = sum(own_us(e) for e in events) or 1.0
    rows = [dict(kernel=e.key[:120], calls=e.count, total_us=round(own_us(e), 1),
                 mean_us=round(own_us(e) / max(e.count, 1), 2), share=round(own_us(e) / total, 4))
            for e in events[:top]]
    return rows, total


# (module, class or None for a module function, name) timed by --host-times; the plugin's sampler
# replaces vLLM's Sampler (module functions are timed where their caller looks them up)
HOST_TIMED = (
    ("vllm.v1.engine.llm_engine", "LLMEngine", "step"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "postprocess_sampled"),
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler", "__call__"),
    ("rollout_service.vllm.plugin.runner_v2", "CanonicalSampler", "__call__"),
    ("vllm.v1.worker.gpu.async_utils", "AsyncOutput", "get_output"),  # waits for the GPU's results
    ("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM", "compute_logits"),
    ("rollout_service.vllm.plugin.model", "ZeroKLForCausalLM", "compute_logits"),
    ("rollout_service.vllm.plugin.runner_v2", "RequestTable", "rows"),
    ("rollout_service.vllm.plugin.runner_v2", None, "canonical_rows"),
    ("rollout_service.vllm.plugin.runner_v2", None, "own_sampler_output"),
    ("rollout_service.vllm.sampler_graphs", "SamplerGraphs", "__call__"),
    ("rollout_service.engine.sampler", None, "sample_with_logprobs"),
    ("kernels", None, "matmul"),  # the plugin's lm_head (ops.logits looks it up per call)
    ("vllm.v1.worker.gpu.input_batch", None, "get_num_sampled_and_rejected"),  # own_sampler_output's
    ("vllm.v1.worker.gpu.sample.sampler", None, "get_num_sampled_and_rejected"),  # vLLM's sampler's
    ("vllm.v1.worker.gpu.sample.sampler", None, "compute_topk_logprobs"),
    ("vllm.v1.worker.gpu.sample.sampler", None, "gumbel_sample"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_attn"),
    ("vllm.v1.worker.gpu.model_states.default", "DefaultModelState", "prepare_attn"),
    ("vllm.v1.worker.gpu.model_states.default", "DefaultModelState", "add_request"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "ModelCudaGraphManager", "run_fullgraph"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder", "build"),
    ("rollout_service.vllm.plugin.attention", "ZeroKLMetadataBuilder", "build"),
)


def _time_host_functions() -> dict[str, list[float]]:
    """Wraps HOST_TIMED (those the installed vLLM has) to append each call's wall seconds to the
    returned dict's list for "Class.method"; call before building the engine."""
    import functools
    import importlib
    durations: dict[str, list[float]] = collections.defaultdict(list)
    for module, cls_name, method in HOST_TIMED:
        try:
            owner = importlib.import_module(module)
            owner = owner if cls_name is None else getattr(owner, cls_name)
        except (ImportError, AttributeError):
            continue
        if method not in vars(owner):
            continue
        key, inner = f"{cls_name or module.rsplit('.', 1)[-1]}.{method}", vars(owner)[method]

        def timed(*a, _inner=inner, _key=key, **kw):
            start = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                durations[_key].append(time.perf_counter() - start)
        setattr(owner, method, functools.wraps(inner)(timed))
    return durations


# decode batch sizes (rows of every product) in the launch tables' bands, for --host-times' step_rows
ROW_BANDS = ((1, 64), (65, 128), (129, 144), (145, 192), (193, 256), (257, None))


def record_step_rows() -> list[tuple[int, int, int]]:
    """Wraps vLLM's Scheduler.schedule to append (scheduled tokens, scheduled requests, requests with
    one token) per step to the returned list; call before building the engine."""
    import functools

    from vllm.v1.core.sched.scheduler import Scheduler
    steps: list[tuple[int, int, int]] = []
    inner = Scheduler.schedule

    @functools.wraps(inner)
    def schedule(self, *a, **kw):
        out = inner(self, *a, **kw)
        if out.total_num_scheduled_tokens:
            per_request = out.num_scheduled_tokens.values()
            steps.append((out.total_num_scheduled_tokens, len(per_request), sum(n == 1 for n in per_request)))
        return out
    Scheduler.schedule = schedule
    return steps


def step_rows(steps: list[tuple[int, int, int]]) -> dict:
    """Decode steps (one token per request: the products' M is the batch) counted by ROW_BANDS; the
    steps with prefill chunks (eager above the largest graph size, and under FULL_DECODE_ONLY), their
    tokens (decode rows included) and the prompt tokens among them (requests given more than one
    token: prompts, and the recompute of preempted sequences)."""
    decode = [requests for tokens, requests, single in steps if single == requests]
    mixed = sorted(tokens for tokens, requests, single in steps if single != requests)
    bands = {f"{lo}-{hi}" if hi else f">={lo}": sum(lo <= m and (hi is None or m <= hi) for m in decode)
             for lo, hi in ROW_BANDS}
    return dict(decode_steps=len(decode), decode_rows=bands, prefill_steps=len(mixed), prefill_step_tokens=sum(mixed),
                prefill_median_tokens=mixed[len(mixed) // 2] if mixed else 0,
                prompt_tokens=sum(tokens - single for tokens, requests, single in steps if single != requests))


def _host_table(durations: dict[str, list[float]], steps: int) -> list[dict]:
    """Per function: calls, mean microseconds per engine step, and the median call (decode steps,
    which outnumber prefill steps)."""
    import statistics
    rows = [dict(function=k, calls=len(v), us_per_step=round(1e6 * sum(v) / steps, 1),
                 median_call_us=round(1e6 * statistics.median(v), 1)) for k, v in durations.items() if v]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _idle_gaps(kernels: list[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    """Intervals of at least min_us between the union of the device's kernel intervals."""
    gaps, end = [], None
    for start, stop in sorted(kernels):
        if end is not None and start - end >= min_us:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


@contextlib.contextmanager
def _host_stalls(top: int = 10):
    """Host pauses that launch no GPU work: Python's garbage collections (per generation) and Triton
    compilations (or loads from its disk cache) of kernel variants first met inside the block.
    Yields a dict filled in on exit: count and milliseconds of each, the longest with their start
    (ms from entering the block), so that they can be set against the trace's idle gaps."""
    import gc
    try:
        import triton
        knobs = triton.knobs.runtime
    except ImportError:  # CPU builds of torch come without Triton: nothing compiles
        knobs = None
    result: dict = {}
    origin = time.perf_counter()
    gc_runs: list[tuple[int, float, float]] = []
    compiles: list[tuple[str, float, float]] = []
    pending: dict = {}

    def on_gc(phase, info):
        if phase == "start":
            pending["gc"] = time.perf_counter()
        elif "gc" in pending:
            start = pending.pop("gc")
            gc_runs.append((info["generation"], start - origin, time.perf_counter() - start))

    def before_compile(*, key, fn, **_):
        pending[("jit", key)] = time.perf_counter()
        return None  # falsy: Triton goes on to compile

    def after_compile(*, key, fn, **_):
        start = pending.pop(("jit", key), None)
        if start is not None:
            compiles.append((fn.name, start - origin, time.perf_counter() - start))

    saved = (knobs.jit_cache_hook, knobs.jit_post_compile_hook) if knobs is not None else None
    gc.callbacks.append(on_gc)
    if knobs is not None:
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = before_compile, after_compile
    try:
        yield result
    finally:
        gc.callbacks.remove(on_gc)
        if knobs is not None:
            knobs.jit_cache_hook, knobs.jit_post_compile_hook = saved
        by_generation = collections.defaultdict(list)
        for generation, _, seconds in gc_runs:
            by_generation[generation].append(seconds)
        result.update(
            gc={f"gen{g}": dict(count=len(v), ms=round(1000 * sum(v), 1)) for g, v in sorted(by_generation.items())},
            longest_gc=[dict(generation=g, at_ms=round(1000 * at, 1), ms=round(1000 * d, 2))
                        for g, at, d in sorted(gc_runs, key=lambda c: -c[2])[:top]],
            triton_compiles=dict(count=len(compiles), ms=round(1000 * sum(d for _, _, d in compiles), 1)),
            longest_compiles=[dict(kernel=name, at_ms=round(1000 * at, 1), ms=round(1000 * d, 2))
                              for name, at, d in sorted(compiles, key=lambda c: -c[2])[:top]])


def _largest_gaps(events: list[dict], gaps: list[tuple[float, float]], first: float, top: int,
                  ops_per_gap: int = 6) -> list[dict]:
    """The longest idle gaps: where they fall (ms from the first device event), the device work on
    either side, and the host ops (torch ops, CUDA runtime calls, annotations) that overlap each one
    most, so that a long gap names what the host was doing without Python tracing."""
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    ends = [e["ts"] + e["dur"] for e in device]
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")]
    rows = []
    for start, stop in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        before = max((e for e, end in zip(device, ends) if end <= start + 1e-3), key=lambda e: e["ts"] + e["dur"],
                     default=None)
        after = next((e for e in device if e["ts"] >= stop - 1e-3), None)
        overlap: collections.Counter = collections.Counter()
        for e in host:
            o = min(stop, e["ts"] + e["dur"]) - max(start, e["ts"])
            if o > 0:
                overlap[f'{e["cat"]}: {e["name"][:100]}'] += o
        rows.append(dict(at_ms=round((start - first) / 1000, 2), us=round(stop - start, 1),
                         before=before["name"][:100] if before else None, after=after["name"][:100] if after else None,
                         host=[dict(op=k, us=round(v, 1)) for k, v in overlap.most_common(ops_per_gap)]))
    return rows


def _overlap(start: float, stop: float, gaps: list[tuple[float, float]], starts: list[float]) -> float:
    import bisect
    total, i = 0.0, max(bisect.bisect_right(starts, start) - 1, 0)
    while i < len(gaps) and gaps[i][0] < stop:
        total += max(0.0, min(stop, gaps[i][1]) - max(start, gaps[i][0]))
        i += 1
    return total


def _timeline(run, top: int, stacks: bool, min_gap_us: float = 20.0) -> dict:
    """GPU busy share of run(), its idle gaps (>= min_gap_us) by length, and the CUDA runtime calls
    (count, microseconds). stacks: also the host Python functions that run while the GPU idles
    (own time, minus nested calls, and inclusive time inside the gaps), from the thread that runs
    the engine; Python tracing slows the host, so idle shares are then inflated."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks) as prof, \
            _host_stalls() as stalls:
        run()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    device = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not device:
        return dict(error="no device events traced")
    first, last = min(s for s, _ in device), max(t for _, t in device)
    gaps = _idle_gaps(device, min_gap_us)
    starts = [g[0] for g in gaps]
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    runtime: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    engine_threads = {(e["pid"], e["tid"]) for e in events if e.get("cat") == "python_function"
                      and "_run_engine" in e["name"]}
    for thread in engine_threads:
        frames = sorted((e for e in events if e.get("cat") == "python_function" and (e["pid"], e["tid"]) == thread),
                        key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, gap overlap, children's gap overlap]
        def close(until: float):
            while stack and stack[-1][0] <= until:
                end, name, mine, children = stack.pop()
                own[name] += mine - children
                if stack:
                    stack[-1][3] += mine
        for e in frames:
            close(e["ts"])
            mine = _overlap(e["ts"], e["ts"] + e["dur"], gaps, starts)
            inclusive[e["name"]] += mine
            stack.append([e["ts"] + e["dur"], e["name"], mine, 0.0])
        close(float("inf"))
    for e in events:
        if e.get("cat") == "cuda_runtime":
            runtime[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    span = last - first
    idle = sum(b - a for a, b in gaps)
    lengths = sorted(b - a for a, b in gaps)

    def table(counter):
        return [dict(function=k[:140], us=round(v, 1)) for k, v in counter.most_common(top) if v > 0]
    return dict(host_stalls=stalls, largest_gaps=_largest_gaps(events, gaps, first, top),
                device_span_ms=round(span / 1000, 2), idle_ms=round(idle / 1000, 2),
                idle_share=round(idle / span, 4), gaps=len(gaps), min_gap_us=min_gap_us,
                gap_us_quantiles={q: round(lengths[int(q * (len(lengths) - 1))], 1) for q in (0.5, 0.9, 0.99)}
                if lengths else {},
                cuda_runtime=[dict(call=k, count=calls[k], us=round(v, 1)) for k, v in runtime.most_common(top)],
                idle_by_own_time=table(own), idle_by_inclusive_time=table(inclusive))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--shape", default="qwen1.5b")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--system", default="vllm-plugin")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--stock-logprobs", action=argparse.BooleanOptionalAction, default=True,
                   help="stock systems return each token's log-prob, as the plugin's always do and the speed "
                        "tables ask (--no-stock-logprobs: none)")
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p, gpu_memory_utilization=0.5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--full-warmups", type=int, default=0,
                   help="whole passes of the workload before the measured one (as the speed tables' later passes)")
    p.add_argument("--kernels", action="store_true", help="list GPU kernels by device time instead")
    p.add_argument("--host-times", action="store_true", help="host time per step in the engine's functions instead")
    p.add_argument("--timeline", action="store_true", help="GPU idle time and the CUDA runtime calls instead")
    p.add_argument("--stacks", action="store_true", help="with --timeline: the host functions run while the GPU idles")
    p.add_argument("--pstats", help="default mode: also write cProfile's raw stats here (pstats.Stats reads them)")
    p.add_argument("--out")
    args = p.parse_args()
    tmp = None
    if not args.model:
        from bench.rollout import save_model
        tmp = tempfile.TemporaryDirectory(prefix="step-profile-")
        save_model(args.shape, tmp.name, args.num_layers)
        args.model = tmp.name
    import transformers
    prompts = workload(args, transformers.AutoConfig.from_pretrained(args.model).vocab_size)
    host_totals = _time_host_functions() if args.host_times else None
    step_log = record_step_rows() if args.host_times else None
    llm = build_llm(args, args.system, len(prompts))
    params = request_params(args, args.system, prompts)
    inputs = [{"prompt_token_ids": q} for q in prompts]

    def generate():
        llm.reset_prefix_cache()
        return llm.generate(inputs, params, use_tqdm=False)

    llm.generate(inputs, [capped(q, 8) for q in params], use_tqdm=False)  # warm-up: every prefill shape
    for _ in range(args.full_warmups):
        generate()
    start = time.perf_counter()
    outs = generate()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = args.max_tokens  # decode steps of one generate (prefill steps add a few)
    common = dict(benchmark="vllm_step_profile", system=args.system, shape=None if tmp is None else args.shape,
                  prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                  stock_logprobs=args.stock_logprobs, logprobs_layout=args.logprobs_layout, **engine_facts(llm),
                  tokens_per_s=round(tokens / seconds, 1), ms_per_step=round(1000 * seconds / steps, 3))
    if args.kernels:
        rows, total_us = _kernel_table(generate, args.top)
        emit(dict(common, kernel_time_s=round(total_us / 1e6, 3), kernels=rows), args.out)
        return
    if host_totals is not None:
        host_totals.clear()
        step_log.clear()
        generate()
        steps = len(host_totals["LLMEngine.step"]) or 1
        emit(dict(common, engine_steps=steps, step_rows=step_rows(step_log),
                  host_per_step=_host_table(host_totals, steps)), args.out)
        return
    if args.timeline:
        emit(dict(common, timeline=_timeline(generate, args.top, args.stacks)), args.out)
        return
    sites = _sync_sites(generate)
    profiler = cProfile.Profile()
    profiler.runcall(generate)
    if args.pstats:
        profiler.dump_stats(args.pstats)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    emit(dict(common, sync_sites_per_step={k: round(v / steps, 2) for k, v in sites.most_common(30)},
              host_top=_import_relative(text.getvalue()).splitlines()[:args.top + 12]), args.out)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
