"""A system's engine built and warmed up: what its timed passes run."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from bench.peer.engines import (
    build_llm,
    capped,
    engine_facts,
    lora_request,
    on_cpu,
    request_params,
    vllm_options,
)
from bench.peer.systems import WORKER_OFF_ENGINES


@dataclasses.dataclass
class Warmed:
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


def warm_vllm(args, prompts, system: str) -> Warmed:
    llm = build_llm(args, system, len(prompts), own_process=args.engine_core == "own-process")
    params = request_params(args, system, prompts)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    adapter = lora_request(args)

    def generate(max_tokens: int | None = None):
        llm.reset_prefix_cache()
        run_params = params if max_tokens is None else [capped(p, max_tokens) for p in params]
        start = time.perf_counter()
        outs = llm.generate(inputs, run_params, lora_request=adapter, use_tqdm=False)
        return time.perf_counter() - start, outs

    generate(args.warmup_tokens)  # every prefill shape of the workload (Triton compiles per shape)
    prefill_s, _ = generate(1)
    return Warmed(generate, dict(prefill_seconds=round(prefill_s, 3), **engine_facts(llm)),
                   tokens=lambda outs: sum(len(o.outputs[0].token_ids) for o in outs))


def warm_worker_engine(args, prompts, mode: str, stock_in_process: bool = True) -> Warmed:
    """VLLMEngine, as a RolloutWorker runs it on a GPU. For `off` its stock engine and its canonical
    engine each get the vllm system's memory share."""
    from rollout_service import SamplingParams
    from rollout_service.vllm.engine import VLLMEngine
    options = vllm_options(args)
    max_model_len = options.pop("max_model_len")
    options.pop("enforce_eager", None)  # VLLMEngine sets it (graphs on CUDA only)
    stock = mode == "off"
    share = min(0.9, options.pop("gpu_memory_utilization", 0.425) * (WORKER_OFF_ENGINES if stock else 1))
    engine = VLLMEngine(args.model, device="cpu" if on_cpu() else "cuda", max_model_len=max_model_len,
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
    return Warmed(generate, engine_facts((engine.stock if stock else engine.canonical).llm), tokens,
                   close=engine.close)


def warm(args, prompts, system: str) -> Warmed:
    if system.startswith("vllm"):
        return warm_vllm(args, prompts, system)
    if system == "worker-off-own-process":
        return warm_worker_engine(args, prompts, "off", stock_in_process=False)
    return warm_worker_engine(args, prompts, system.split("-", 1)[1])
