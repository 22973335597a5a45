"""vLLM plugin: vLLM's own engine (scheduler, chunked prefill, prefix caching, paged KV) runs the
canonical forward (kernels.forward), so its log-probs equal trainer_patch.token_logprobs bit for bit.

`register()` is the `vllm.general_plugins` entry point (pyproject.toml): it makes the architecture
`ZeroKLForCausalLM` known to vLLM and binds vLLM's CUSTOM attention backend to ours. An engine opts in
per checkpoint with `LLM(model=path, **llm_options(path))`; stock classes stay available. Sampling
(vllm.plugin.sampling) reaches vLLM one of two ways, by model runner: on V1 a logits processor, on V2
(vLLM's default for dense models on GPU, which refuses V1-style processors) the model's own sampler
(vllm.plugin.runner_v2). `pick_runner` says which one vLLM will run.

Nothing here imports vLLM at module import time: `import rollout_service` works without it.
"""
from __future__ import annotations

import copy
import os

import torch

from rollout_service.vllm.plugin.sampling import PROCESSOR_FQCN, seed_of

ARCHITECTURE = "ZeroKLForCausalLM"
MODEL_QUALNAME = f"{__name__}.model:ZeroKLForCausalLM"
BACKEND_QUALNAME = f"{__name__}.attention.ZeroKLAttentionBackend"
HF_OVERRIDES = {"architectures": [ARCHITECTURE]}
ENTRY_POINT = f"{__name__}:register"  # pyproject.toml's vllm.general_plugins entry
RUNNERS = ("v1", "v2")
# The token counts of the steps vLLM's V2 runner replays from full CUDA graphs, prefill chunks included:
# vLLM's decode sizes, then coarser ones up to 4,096 tokens (a step pads up to the next size).
GRAPH_CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 512, 16), *range(512, 1024, 64),
                       *range(1024, 4097, 256))
# Full CUDA graphs; nothing is compiled (mode 0: the canonical ops are Triton kernels). Rule: on V2 at
# one rank every step of up to max(GRAPH_CAPTURE_SIZES) tokens replays a graph ("all_steps"), prefill
# included, because an eager step launches its Triton kernels from Python, and at Qwen2.5-1.5B shapes
# a 2,048-token prefill then leaves the GPU idle most of its span
# (bench/results/2026-11-29-h200x2-prefill-graphs). Larger steps run
# eagerly, where the kernels' own time hides the launches. Elsewhere decode steps only: V1 (MoE
# checkpoints, and `vllm serve`, whose logits processor keeps vLLM on V1) and tensor parallelism,
# where graphs holding prefill steps are unmeasured.
CUDA_GRAPH_COMPILATION = {
    "all_steps": {"mode": 0, "cudagraph_mode": "FULL", "cudagraph_capture_sizes": list(GRAPH_CAPTURE_SIZES)},
    "decode_steps": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
}


def graph_options(cuda_graphs: bool = True, runner: str = "v2", tensor_parallel_size: int = 1) -> dict:
    """vLLM keywords for the plugin's CUDA graphs on `runner` over `tensor_parallel_size` ranks
    (CUDA_GRAPH_COMPILATION's rule); False: enforce_eager. Same bits either way; the CPU build ignores
    graphs."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if not cuda_graphs:
        return {"enforce_eager": True}
    steps = "all_steps" if runner == "v2" and tensor_parallel_size == 1 else "decode_steps"
    return {"compilation_config": copy.deepcopy(CUDA_GRAPH_COMPILATION[steps])}


def pick_runner(model: str | os.PathLike | None = None) -> str:
    """The model runner vLLM picks for the plugin: "v2" on CUDA for a dense checkpoint (vLLM runs MoE
    models on V1 by default, and its CPU build has no V2) unless VLLM_USE_V2_MODEL_RUNNER=0; else "v1".
    `model`: the checkpoint (its config tells dense from MoE); None counts as dense."""
    if not torch.cuda.is_available() or os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("0", "false"):
        return "v1"
    if model is not None:
        import transformers
        config = transformers.AutoConfig.from_pretrained(str(model))
        if getattr(config, "num_experts", 0):
            return "v1"
    return "v2"


def runner_options(runner: str) -> dict:
    """The vLLM keywords that carry our sampling rule on `runner`: V1 takes our logits processor and
    reports the processed logits as log-probs; V2 needs none (the model state installs our sampler,
    and a logits processor would send vLLM back to V1)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    return dict(logits_processors=[PROCESSOR_FQCN], logprobs_mode="processed_logits") if runner == "v1" else {}


def llm_options(model: str | os.PathLike | None = None, *, cuda_graphs: bool = True, runner: str | None = None,
                tensor_parallel_size: int = 1) -> dict:
    """The `vllm.LLM` / engine-args keywords that run checkpoint `model` on the canonical model with
    our seeded sampling rule, on `runner` (default: pick_runner(model)), over `tensor_parallel_size`
    workers (vllm.plugin.tensor_parallel: row-parallel outputs combined by the segment tree)."""
    from rollout_service.vllm.plugin.tensor_parallel import tp_options
    if tensor_parallel_size != 1:
        require_entry_point()
    runner = runner or pick_runner(model)
    return dict(hf_overrides=dict(HF_OVERRIDES), **runner_options(runner),
                **graph_options(cuda_graphs, runner, tensor_parallel_size), **tp_options(model, tensor_parallel_size))


def require_entry_point() -> None:
    """Raises unless vLLM's own processes will load this plugin: its `vllm.general_plugins` entry point
    installed, and not left out by VLLM_PLUGINS (vLLM's allow-list of plugin names). Processes vLLM
    starts (an engine core of its own, tensor-parallel workers) learn the canonical model only
    through it."""
    from importlib.metadata import entry_points
    names = [ep.name for ep in entry_points(group="vllm.general_plugins") if ep.value == ENTRY_POINT]
    if not names:
        raise RuntimeError(f"the vLLM plugin's entry point ({ENTRY_POINT}) is not installed, so vLLM's own "
                           "processes cannot build the canonical model: install this package "
                           "(pip install -e .) in the environment that runs vLLM")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and names[0] not in allowed.split(","):
        raise RuntimeError(f"VLLM_PLUGINS={allowed!r} leaves out this package's vLLM plugin {names[0]!r}, so "
                           "vLLM's own processes cannot build the canonical model: add it to VLLM_PLUGINS")


def register() -> None:
    """Idempotent; vLLM calls it in every process that builds an engine."""
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_QUALNAME)
    # Our layers name their backend class directly (Attention(attn_backend=...)); vLLM still maps
    # get_name() back to an enum member, so CUSTOM must point at it.
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_QUALNAME)
    # requests with vLLM's own sampling fields get our rule too (vllm.plugin.sampling.canonical_request)
    from rollout_service.vllm.plugin.compat import install_request_rule
    from rollout_service.vllm.plugin.sampling import canonical_request
    install_request_rule(canonical_request, ARCHITECTURE)
    # enable_lora: the canonical model's adapters are ours (vllm.plugin.request_adapters)
    from rollout_service.vllm.plugin.compat import install_lora_manager
    install_lora_manager(ARCHITECTURE, _request_adapters)


def _request_adapters(model, vllm_config):
    from rollout_service.vllm.plugin.request_adapters import RequestAdapters  # imported once LoRA is asked for
    return RequestAdapters(model, vllm_config)


__all__ = ["ARCHITECTURE", "CUDA_GRAPH_COMPILATION", "GRAPH_CAPTURE_SIZES", "HF_OVERRIDES", "RUNNERS", "graph_options",
           "llm_options", "pick_runner", "register", "require_entry_point", "runner_options", "seed_of"]
