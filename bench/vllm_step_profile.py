"""Where a vLLM system's generate time goes on the host: device syncs (with the Python stack that
issued each) and the functions that take the most host time.

    python -m bench.vllm_step_profile --shape qwen1.5b --system vllm-plugin --prompts 64 \
        --prompt-len 512 --max-tokens 128

One system per process (as bench.peer_vllm runs them). Prints one JSON object: tokens/s of a plain
timed generate, the engine's model runner / async scheduling, the distinct synchronising call sites
(torch's sync debug mode) with their counts per generated step, and cProfile's top functions by own
time. `--kernels`: instead, the GPU kernels of one generate by total device time (torch.profiler;
kernels replayed from CUDA graphs are listed where CUPTI traces them, else use --system *-eager).
"""
from __future__ import annotations

import argparse
import cProfile
import collections
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
from bench.peer_vllm import _capped, _workload, build_llm, engine_facts, request_params  # noqa: E402


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


def _kernel_table(run, top: int) -> list[dict]:
    """The `top` GPU kernels of run() by total device time (on CPU: torch ops by own CPU time): name,
    calls, total and mean microseconds, share."""
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
    return [dict(kernel=e.key[:120], calls=e.count, total_us=round(own_us(e), 1),
                 mean_us=round(own_us(e) / max(e.count, 1), 2), share=round(own_us(e) / total, 4))
            for e in events[:top]]


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
    p.add_argument("--stock-logprobs", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--kernels", action="store_true", help="list GPU kernels by device time instead")
    p.add_argument("--out")
    args = p.parse_args()
    tmp = None
    if not args.model:
        from bench.rollout import save_model
        tmp = tempfile.TemporaryDirectory(prefix="step-profile-")
        save_model(args.shape, tmp.name, args.num_layers)
        args.model = tmp.name
    import transformers
    prompts = _workload(args, transformers.AutoConfig.from_pretrained(args.model).vocab_size)
    llm = build_llm(args, args.system, len(prompts))
    params = request_params(args, args.system, prompts)
    inputs = [{"prompt_token_ids": q} for q in prompts]

    def generate():
        llm.reset_prefix_cache()
        return llm.generate(inputs, params, use_tqdm=False)

    llm.generate(inputs, [_capped(q, 8) for q in params], use_tqdm=False)  # warm-up: every prefill shape
    start = time.perf_counter()
    outs = generate()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = args.max_tokens  # decode steps of one generate (prefill steps add a few)
    common = dict(benchmark="vllm_step_profile", system=args.system, shape=None if tmp is None else args.shape,
                  prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens, **engine_facts(llm),
                  tokens_per_s=round(tokens / seconds, 1), ms_per_step=round(1000 * seconds / steps, 3))
    if args.kernels:
        emit(dict(common, kernels=_kernel_table(generate, args.top)), args.out)
        return
    sites = _sync_sites(generate)
    profiler = cProfile.Profile()
    profiler.runcall(generate)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    emit(dict(common, sync_sites_per_step={k: round(v / steps, 2) for k, v in sites.most_common(30)},
              host_top=text.getvalue().splitlines()[:args.top + 12]), args.out)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
