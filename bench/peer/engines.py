"""The workload, the engine options every system shares, and the vllm.LLM of a `vllm*` system with its
requests."""
from __future__ import annotations

import argparse
import os
import random

import torch


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def on_cpu() -> bool:
    import torch
    return not torch.cuda.is_available()


def vllm_options(args, max_model_len: int | None = None) -> dict:
    """max_model_len: the longest context a request may reach (default: a prompt of the workload and its
    completion, with room to spare)."""
    opts = dict(max_model_len=max_model_len or args.prompt_len + args.max_tokens + 8)
    if on_cpu():
        opts.update(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mib << 20)
    else:
        opts.update(gpu_memory_utilization=args.gpu_memory_utilization)
        if args.num_gpu_blocks:  # the same KV cache for every system, whatever profiling would leave it
            opts.update(num_gpu_blocks_override=args.num_gpu_blocks)
    return opts


def kv_settings(args) -> dict:
    """What sized the engines' KV caches (a report's record of the workload)."""
    if on_cpu():
        return dict(kv_cache_mib=args.kv_cache_mib)
    return dict(gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks=args.num_gpu_blocks)


def add_workload_args(p: argparse.ArgumentParser, prompt_len: int, max_tokens: int, prompts: int = 64) -> None:
    """The workload and sampling options request_params reads: one definition for every tool that sends
    requests through it."""
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    # on by default: an RL rollout needs each token's log-prob (the stock pipeline's importance-sampling
    # correction reads them), and the plugin always returns it, so stock without it does less work
    p.add_argument("--stock-logprobs", action=argparse.BooleanOptionalAction, default=True,
                   help="stock systems return each token's log-prob (logprobs=0), as ours always do "
                        "(--no-stock-logprobs: none)")
    p.add_argument("--seed", type=int, default=0)


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


LORA_SYSTEMS = ("vllm", "vllm-plugin")  # the systems --lora runs: stock vLLM's LoRA and ours, CUDA graphs on


def default_checkpoint(args, prefix: str):
    """Where --model is not given, random weights saved to a temp dir for `args.model`: the --shape's (with
    --num-layers), else a tiny Qwen2. Returns the TemporaryDirectory to clean up (None where --model was given)."""
    if args.model:
        return None
    import tempfile
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    if getattr(args, "shape", None):
        from bench.rollout import save_model
        save_model(args.shape, tmp.name, getattr(args, "num_layers", None))
    else:
        from bench.peer.systems import TINY_KW
        from rollout_service.tiny_models import tiny_model
        tiny_model("qwen2", seed=0, **TINY_KW).save_pretrained(tmp.name)
    args.model = tmp.name
    return tmp


def lora_settings(r: int) -> dict:
    from rollout_service.lora import PROJECTIONS
    return {"r": r, "alpha": 2.0 * r, "target_modules": sorted(n for names in PROJECTIONS.values() for n in names),
            "use_rslora": False}


def save_random_adapter(model_dir: str, r: int, path: str) -> str:
    """An r-rank adapter on every projection of the checkpoint's model, saved as a PEFT checkpoint: random A and
    B (B nonzero, so that the adapter's product changes the tokens, as a trained adapter's does)."""
    import transformers

    from rollout_service.lora import save_adapter
    from rollout_service.vllm.plugin.lora import zero_adapter
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    adapter = zero_adapter(model, lora_settings(r))
    gen = torch.Generator().manual_seed(0)
    for name, t in adapter.tensors.items():
        scale = t.shape[1] ** -0.5 if ".lora_A." in name else 0.01
        t.copy_(torch.randn(t.shape, generator=gen) * scale)
    return str(save_adapter(adapter, path))


def lora_request(args):
    """vLLM's LoRARequest of the --lora adapter (every request names it), or None."""
    if not getattr(args, "lora", 0):  # tools without --lora (bench.vllm_step_profile) run no adapter
        return None
    from vllm.lora.request import LoRARequest
    return LoRARequest("bench", 1, args.lora_dir)


def build_llm(args, system: str, max_num_seqs: int, own_process: bool = False, max_model_len: int | None = None,
              extra_options: dict | None = None):
    """The vllm.LLM of a `vllm*` system, its engine core in this process or its own (VLLM_BATCH_INVARIANT
    comes from the env). vllm-plugin*: the canonical model class and our seeded sampling rule.
    max_model_len: as vllm_options takes it; extra_options: more vllm.LLM keywords, the same for every system."""
    if system == "vllm-v1":  # stock on the model runner the plugin uses (vLLM 0.25 defaults to V2)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    from vllm import LLM
    options = dict(vllm_options(args, max_model_len), **(extra_options or {}))
    if system == "vllm-eager":
        options["enforce_eager"] = True
    k = args.tensor_parallel_size
    if system.startswith("vllm-plugin"):
        from rollout_service.vllm.plugin import (
            llm_options,
            register,
            require_entry_point,
        )
        register()  # in-process engine core: the entry point may not be installed
        if own_process:
            require_entry_point()  # vLLM's engine-core process builds the model
        options.update(llm_options(args.model, cuda_graphs=system != "vllm-plugin-eager" and not on_cpu(),
                                   runner="v1" if system == "vllm-plugin-v1" else None, tensor_parallel_size=k))
        reduce = {"vllm-plugin-gather": "tree", "vllm-plugin-scatter": "tree_scatter"}.get(system)
        if reduce:  # TP > 1: the same tree, scheduled otherwise
            from rollout_service.vllm.plugin.tensor_parallel import TP_REDUCE_KEY
            options["additional_config"] = {TP_REDUCE_KEY: reduce}
    else:
        from rollout_service.vllm.plugin.tensor_parallel import tp_options
        options.update(tp_options(None, k))
    if lora_request(args) is not None:  # one adapter for every request; the plugin's sized before capture
        from rollout_service.vllm.adapters import vllm_lora_rank
        options.update(enable_lora=True, max_loras=1,
                       max_lora_rank=vllm_lora_rank(args.lora))
        if system.startswith("vllm-plugin"):
            from rollout_service.vllm.plugin.lora import lora_hint
            options["hf_overrides"] = {**options["hf_overrides"], **lora_hint(**lora_settings(args.lora))}
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


def capped(params, max_tokens: int):
    capped = params.clone()
    capped.max_tokens = min(max_tokens, params.max_tokens)
    return capped
