"""--timeline: how busy the GPU is during a generate, its idle gaps and what the host did in them."""
from __future__ import annotations

import collections
import contextlib
import tempfile
import time


def idle_gaps(kernels: list[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    """Intervals of at least min_us between the union of the device's kernel intervals."""
    gaps, end = [], None
    for start, stop in sorted(kernels):
        if end is not None and start - end >= min_us:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


@contextlib.contextmanager
def host_stalls(top: int = 10):
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
        # falsy: Triton goes on to compile

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


def largest_gaps(events: list[dict], gaps: list[tuple[float, float]], first: float, top: int,
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


def timeline(run, top: int, stacks: bool, min_gap_us: float = 20.0) -> dict:
    """GPU busy share of run(), its idle gaps (>= min_gap_us) by length, and the CUDA runtime calls
    (count, microseconds). stacks: also the host Python functions that run while the GPU idles
    (own time, minus nested calls, and inclusive time inside the gaps), from the thread that runs
    the engine; Python tracing slows the host, so idle shares are then inflated."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks) as prof, \
            host_stalls() as stalls:
        run()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    device = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not device:
        return dict(error="no device events traced")
    first, last = min(s for s, _ in device), max(t for _, t in device)
    gaps = idle_gaps(device, min_gap_us)
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
    return dict(host_stalls=stalls, largest_gaps=largest_gaps(events, gaps, first, top),
                device_span_ms=round(span / 1000, 2), idle_ms=round(idle / 1000, 2),
                idle_share=round(idle / span, 4), gaps=len(gaps), min_gap_us=min_gap_us,
                gap_us_quantiles={q: round(lengths[int(q * (len(lengths) - 1))], 1) for q in (0.5, 0.9, 0.99)}
                if lengths else {},
                cuda_runtime=[dict(call=k, count=calls[k], us=round(v, 1)) for k, v in runtime.most_common(top)],
                idle_by_own_time=table(own), idle_by_inclusive_time=table(inclusive))
