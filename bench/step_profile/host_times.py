"""--host-times: host time per engine step in the engine's own functions, timed by wrapping them, and
the decode steps counted by batch size."""
from __future__ import annotations

import collections
import time

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


def time_host_functions() -> dict[str, list[float]]:
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


def host_table(durations: dict[str, list[float]], steps: int) -> list[dict]:
    """Per function: calls, mean microseconds per engine step, and the median call (decode steps,
    which outnumber prefill steps)."""
    import statistics
    rows = [dict(function=k, calls=len(v), us_per_step=round(1e6 * sum(v) / steps, 1),
                 median_call_us=round(1e6 * statistics.median(v), 1)) for k, v in durations.items() if v]
    return sorted(rows, key=lambda r: -r["us_per_step"])
