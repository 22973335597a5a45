"""vLLM plugin: vLLM's own engine (scheduler, chunked prefill, prefix caching, paged KV) runs the
canonical forward (kernels.forward), so its log-probs equal trainer_patch.token_logprobs bit for bit.

`register()` is the `vllm.general_plugins` entry point (pyproject.toml): it makes the architecture
`ZeroKLForCausalLM` known to vLLM and binds vLLM's CUSTOM attention backend to ours. An engine opts in
per checkpoint with `LLM(model=path, **llm_options())`; stock classes stay available. Sampling is
rollout_service.fast_path.vllm.GumbelLogitsProcessor (vLLM at temperature 0,
logprobs_mode="processed_logits").

Nothing here imports vLLM at module import time: `import rollout_service` works without it.
"""
from __future__ import annotations

ARCHITECTURE = "ZeroKLForCausalLM"
MODEL_QUALNAME = f"{__name__}.model:ZeroKLForCausalLM"
BACKEND_QUALNAME = f"{__name__}.attention.ZeroKLAttentionBackend"
HF_OVERRIDES = {"architectures": [ARCHITECTURE]}
# Decode steps replay full CUDA graphs; nothing is compiled (mode 0: the canonical ops are Triton kernels)
CUDA_GRAPH_COMPILATION = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


def graph_options(cuda_graphs: bool = True) -> dict:
    """vLLM keywords for the plugin's CUDA graphs: decode steps replay full graphs
    (CUDA_GRAPH_COMPILATION), prefill runs eagerly; False: enforce_eager. Same bits either way; the
    CPU build ignores graphs."""
    return {"compilation_config": dict(CUDA_GRAPH_COMPILATION)} if cuda_graphs else {"enforce_eager": True}


def llm_options(*, cuda_graphs: bool = True) -> dict:
    """The `vllm.LLM` / engine-args keywords that run a checkpoint on the canonical model with our
    seeded sampling processor."""
    from rollout_service.fast_path.vllm import PROCESSOR_FQCN
    return dict(hf_overrides=dict(HF_OVERRIDES), logits_processors=[PROCESSOR_FQCN],
                logprobs_mode="processed_logits", **graph_options(cuda_graphs))


def register() -> None:
    """Idempotent; vLLM calls it in every process that builds an engine."""
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_QUALNAME)
    # Our layers name their backend class directly (Attention(attn_backend=...)); vLLM still maps
    # get_name() back to an enum member, so CUSTOM must point at it.
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_QUALNAME)


__all__ = ["ARCHITECTURE", "CUDA_GRAPH_COMPILATION", "HF_OVERRIDES", "graph_options", "llm_options", "register"]
