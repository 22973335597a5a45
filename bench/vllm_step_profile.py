"""Where a vLLM system's generate time goes on the host: device syncs (with the Python stack that
issued each) and the functions that take the most host time.

    python -m bench.vllm_step_profile --shape qwen1.5b --system vllm-plugin --prompts 64 \
        --prompt-len 512 --max-tokens 128 [--lora 16]

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
import io
import os
import pstats
import sys
import tempfile
import time

# vLLM logs to stdout unless told otherwise; stdout is this tool's JSON
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import emit
from bench.peer.engines import (
    LORA_SYSTEMS,
    add_engine_args,
    add_workload_args,
    build_llm,
    capped,
    default_checkpoint,
    engine_facts,
    lora_request,
    request_params,
    save_random_adapter,
    workload,
)
from bench.step_profile.device_kernels import kernel_table
from bench.step_profile.host_profile import import_relative, sync_sites
from bench.step_profile.host_times import (
    host_table,
    record_step_rows,
    step_rows,
    time_host_functions,
)
from bench.step_profile.timeline import timeline


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--shape", default="qwen1.5b")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--system", default="vllm-plugin")
    add_workload_args(p, prompt_len=512, max_tokens=128)
    add_engine_args(p, gpu_memory_utilization=0.5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--full-warmups", type=int, default=0,
                   help="whole passes of the workload before the measured one (as the speed tables' later passes)")
    p.add_argument("--kernels", action="store_true", help="list GPU kernels by device time instead")
    p.add_argument("--host-times", action="store_true", help="host time per step in the engine's functions instead")
    p.add_argument("--timeline", action="store_true", help="GPU idle time and the CUDA runtime calls instead")
    p.add_argument("--stacks", action="store_true", help="with --timeline: the host functions run while the GPU idles")
    p.add_argument("--pstats", help="default mode: also write cProfile's raw stats here (pstats.Stats reads them)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="every request through a random rank-R adapter on every projection (as bench.peer_vllm "
                        "--lora: vLLM's enable_lora and LoRARequest); systems vllm and vllm-plugin")
    p.add_argument("--out")
    args = p.parse_args()
    if args.lora and args.system not in LORA_SYSTEMS:
        p.error(f"--lora runs the systems {LORA_SYSTEMS}; got {args.system}")
    tmp = default_checkpoint(args, "step-profile-")  # --shape has a default: its random weights
    lora_tmp = None
    if args.lora:
        lora_tmp = tempfile.TemporaryDirectory(prefix="step-profile-lora-")
        args.lora_dir = save_random_adapter(args.model, args.lora, lora_tmp.name)
    adapter = lora_request(args)
    import transformers
    prompts = workload(args, transformers.AutoConfig.from_pretrained(args.model).vocab_size)
    host_totals = time_host_functions() if args.host_times else None
    step_log = record_step_rows() if args.host_times else None
    llm = build_llm(args, args.system, len(prompts))
    params = request_params(args, args.system, prompts)
    inputs = [{"prompt_token_ids": q} for q in prompts]

    def generate():
        llm.reset_prefix_cache()
        return llm.generate(inputs, params, lora_request=adapter, use_tqdm=False)

    llm.generate(inputs, [capped(q, 8) for q in params], lora_request=adapter,
                 use_tqdm=False)  # warm-up: every prefill shape
    for _ in range(args.full_warmups):
        generate()
    start = time.perf_counter()
    outs = generate()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = args.max_tokens  # decode steps of one generate (prefill steps add a few)
    common = dict(benchmark="vllm_step_profile", system=args.system, shape=None if tmp is None else args.shape,
                  prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens, lora=args.lora,
                  stock_logprobs=args.stock_logprobs, logprobs_layout=args.logprobs_layout, **engine_facts(llm),
                  tokens_per_s=round(tokens / seconds, 1), ms_per_step=round(1000 * seconds / steps, 3))
    if args.kernels:
        rows, total_us = kernel_table(generate, args.top)
        emit(dict(common, kernel_time_s=round(total_us / 1e6, 3), kernels=rows), args.out)
        return
    if host_totals is not None:
        host_totals.clear()
        step_log.clear()
        generate()
        steps = len(host_totals["LLMEngine.step"]) or 1
        emit(dict(common, engine_steps=steps, step_rows=step_rows(step_log),
                  host_per_step=host_table(host_totals, steps)), args.out)
        return
    if args.timeline:
        emit(dict(common, timeline=timeline(generate, args.top, args.stacks)), args.out)
        return
    sites = sync_sites(generate)
    profiler = cProfile.Profile()
    profiler.runcall(generate)
    if args.pstats:
        profiler.dump_stats(args.pstats)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    emit(dict(common, sync_sites_per_step={k: round(v / steps, 2) for k, v in sites.most_common(30)},
              host_top=import_relative(text.getvalue()).splitlines()[:args.top + 12]), args.out)
    for t in (tmp, lora_tmp):
        if t is not None:
            t.cleanup()


if __name__ == "__main__":
    main()
