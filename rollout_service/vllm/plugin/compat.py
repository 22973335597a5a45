"""vLLM internals we depend on beyond its public API: the parts of the KV-cache API that differ between
the versions we run (0.25 on GPU, 0.32 on CPU), vLLM's process-wide graph-capture flag, how an
engine's core is placed in or out of this process (and how that process is started), where a
request's SamplingParams enter an engine (install_request_rule), which LoRA manager a runner keeps
(install_lora_manager), which stock models take weights
in place (stock_loads_in_place), and how a stock model wrapped for LoRA takes its base weights
(lora_wrappers_lifted).

0.25 allocates a layer's cache in the shape the backend's `get_kv_cache_shape` returns; we ask for
[num_blocks, 2, block_size, Hkv, D] (FlashAttention's blocks-first shape) and unbind K and V.
0.32 allocates byte views itself: a layer's cache is a logical [num_blocks, Hkv, block_size, C]
view with C = K and V of one head and token back to back, physically ordered as the backend's
`supported_kv_cache_layouts` allows; we ask for LBNHC (token-major blocks) and split C.
Either way the result is two [num_blocks, block_size, Hkv, D] pools (strided views, no copy).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


class KVLayoutMixin:
    """Declares our KV layout to whichever vLLM is installed (each reads only its own method)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)  # 0.25

    @classmethod
    def supported_kv_cache_layouts(cls):  # 0.32
        from vllm.v1.kv_cache_interface import KVCacheLayout
        return (KVCacheLayout.LBNHC,)


def split_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's vLLM cache tensor -> (k_pool, v_pool), each [num_blocks, block_size, Hkv, D]."""
    if kv_cache.dim() == 5:  # 0.25: [NB, 2, BS, H, D]
        k, v = kv_cache.unbind(1)
        return k, v
    # 0.32: logical [NB, H, BS, 2D], whatever the physical order
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return k, v


def stock_loads_in_place() -> bool:
    """Whether a stock vLLM model takes new weights through its load_weights after it was loaded. vLLM's
    CPU platform repacks a stock model's linear weights once they are loaded (oneDNN, or replaces them
    with empty parameters), dropping their weight loaders: there only vLLM's reload (reload_weights)
    loads into them. The plugin's model keeps plain parameters on every platform."""
    return torch.cuda.is_available()


def allow_graph_capture() -> None:
    """Restores the process-wide "capture allowed" flag of vllm.compilation.monitor, as a fresh process
    has it. vLLM's V1 runner clears it after capturing its graphs; a later engine in the same process
    whose runner does not set it again (V2 with torch.compile's piecewise graphs) would then refuse to
    capture. Call before building an engine."""
    from vllm.compilation import monitor
    monitor.set_cudagraph_capturing_enabled(True)


def core_start_method(own_process: bool) -> str | None:
    """How vLLM should start an engine core of its own: "spawn" on CUDA, unless the user chose a method
    (VLLM_WORKER_MULTIPROC_METHOD). vLLM forks unless torch.cuda.is_initialized(), but a process can
    have touched CUDA without that (vLLM 0.25 on an H100 forked the stock engine's core of a worker
    and the child failed with "Cannot re-initialize CUDA in forked subprocess"). None: vLLM decides."""
    if not own_process or START_METHOD_ENV in os.environ or not torch.cuda.is_available():
        return None
    return "spawn"


@contextlib.contextmanager
def engine_core_placement(own_process: bool):
    """Build one vllm.LLM inside this block to place its engine core in its own process (vLLM's
    default; started as core_start_method says) or in this one. vLLM reads the choice from
    VLLM_ENABLE_V1_MULTIPROCESSING when an LLM is built, through vllm.envs, which freezes its reads
    once an in-process engine core has started; so the variables are set for this block only, with
    the freeze lifted meanwhile."""
    from vllm import envs
    frozen = hasattr(envs.__getattr__, "cache_clear")  # envs.enable_envs_cache wraps it in functools.cache
    block = {MULTIPROCESSING_ENV: "1" if own_process else "0"}
    start_method = core_start_method(own_process)
    if start_method is not None:
        block[START_METHOD_ENV] = start_method
    saved = {name: os.environ.get(name) for name in block}
    os.environ.update(block)
    envs.disable_envs_cache()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if frozen and not hasattr(envs.__getattr__, "cache_clear"):
            envs.enable_envs_cache()  # a fresh cache: it reads the restored variables


def install_request_rule(rule, architecture: str) -> None:
    """Every request's SamplingParams pass through `rule` ((params, request id) -> params, or
    ValueError, raised as vLLM's VLLMValidationError: a 400 from the server) where they enter an
    engine whose model is `architecture`, before vLLM validates and copies them and before an n > 1
    request fans out into its samples (which take seed + index).
    That entry is InputProcessor.process_inputs(self, request_id, prompt, params, ...) in 0.25 and
    0.32 alike; the engine's own processes and the OpenAI server's call it, so do vllm.LLM's. Other
    engines of the process (a stock model class) are left alone. Idempotent."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor.process_inputs
    if getattr(original, "_zerokl_rule", False):
        return

    @functools.wraps(original)
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        if isinstance(params, SamplingParams) and architecture in (self.model_config.architectures or ()):
            try:
                params = rule(params, request_id)
            except ValueError as e:  # vLLM answers its validation error with a 400, other errors with a 500
                raise VLLMValidationError(str(e)) from e
        return original(self, request_id, prompt, params, *args, **kwargs)

    process_inputs._zerokl_rule = True
    InputProcessor.process_inputs = process_inputs


def install_lora_manager(architecture: str, make_manager) -> None:
    """With enable_lora, a runner whose model's class is `architecture` keeps `make_manager(model, vllm_config)` as its
    LoRA manager instead of vLLM's (vllm/plugin/request_adapters.py says why); other models keep vLLM's.
    The runner builds its manager in LoRAModelRunnerMixin.load_lora_model(model, vllm_config, device), right
    after loading the model, on vLLM's V1 and V2 GPU runners and its CPU runner, in 0.25 and 0.32 alike;
    every later call reaches the manager as `runner.lora_manager`. Idempotent."""
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    original = LoRAModelRunnerMixin.load_lora_model
    if getattr(original, "_zerokl_lora", False):
        return

    @functools.wraps(original)
    def load_lora_model(self, model, vllm_config, device):
        if type(model).__name__ != architecture:
            return original(self, model, vllm_config, device)
        self.lora_manager = make_manager(model, vllm_config)
        model.use_request_adapters(self.lora_manager)
        return model

    load_lora_model._zerokl_lora = True
    LoRAModelRunnerMixin.load_lora_model = load_lora_model


@contextlib.contextmanager
def lora_wrappers_lifted(model: torch.nn.Module):
    """The model's tree with each of vLLM's LoRA wrappers (BaseLayerWithLoRA, which a stock model gets with
    enable_lora) replaced by the layer it wraps, for as long as the block runs; then the wrappers are back.
    Rule: every load of base weights into a vLLM model runs inside it. The wrappers hold their layer as
    `base_layer`, so its parameters are named "...qkv_proj.base_layer.weight"; 0.25's load_weights and
    in-place reload look up "...qkv_proj.weight" and refuse the load (0.32's see through the wrappers).
    Lifted, the names are the checkpoint's and the same parameter objects are written in place, which
    the wrappers (and CUDA graphs captured through them) read. The plugin's model has no wrappers
    (install_lora_manager): nothing changes there."""
    from vllm.lora.layers import BaseLayerWithLoRA

    lifted = []
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseLayerWithLoRA) and name:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            parent._modules[child] = module.base_layer
            lifted.append((parent, child, module))
    try:
        yield model
    finally:
        for parent, child, module in reversed(lifted):
            parent._modules[child] = module
