"""What the vLLM rollout server passes vLLM: the plugin's keywords in `engine_kwargs.vllm`."""
from __future__ import annotations

import functools

from .config import PLUGIN_ENGINE_KEYS, LIB, enabled


def engine_options(model_path: str, tensor_parallel_size: int = 1) -> dict:
    """The vLLM engine arguments that run checkpoint `model_path` on the canonical model with our sampling rule
    (rollout_service.vllm.plugin.llm_options), in the form verl's `rollout.engine_kwargs.vllm` takes them: verl
    turns them into `vllm serve` arguments after its own, so these win."""
    from rollout_service.vllm.plugin import llm_options
    return llm_options(model_path, tensor_parallel_size=tensor_parallel_size)


def merge_engine_kwargs(engine_kwargs: dict, model_path: str, tensor_parallel_size: int = 1) -> dict:
    """engine_kwargs (verl's rollout.engine_kwargs.vllm, after verl's own preprocessing) updated in place with
    engine_options; a key both set raises (config.check_config reports it earlier, in the driver)."""
    options = engine_options(model_path, tensor_parallel_size)
    taken = sorted(key for key in options if key in engine_kwargs and engine_kwargs[key] != options[key])
    if taken:
        raise ValueError(f"rollout.engine_kwargs.vllm sets {taken}, which zero KL ({LIB}) sets itself: leave "
                         f"them out (the integration's keys: {list(PLUGIN_ENGINE_KEYS)})")
    engine_kwargs.update(options)
    return engine_kwargs


def install(module) -> None:
    """Wraps vLLMHttpServer._preprocess_engine_kwargs (verl's in-place pass over engine_kwargs, right before it
    builds the server's arguments); a server whose model config does not turn zero KL on is left as it is."""
    server = module.vLLMHttpServer
    original = server._preprocess_engine_kwargs

    @functools.wraps(original)
    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        original(self, engine_kwargs)
        if enabled(self.model_config):
            from rollout_service.vllm.plugin import require_entry_point
            require_entry_point()  # vLLM's engine core and workers are processes of their own
            merge_engine_kwargs(engine_kwargs, self.model_config.local_path,
                                int(self.config.tensor_model_parallel_size or 1))

    server._preprocess_engine_kwargs = _preprocess_engine_kwargs
