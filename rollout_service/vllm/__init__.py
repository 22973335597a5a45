"""vLLM: the plugin that makes vLLM serve the canonical model (plugin/), VLLMEngine (a rollout
worker's engine on vLLM), VLLMInstance (one vllm.LLM) and the vLLM proposer for the native engine,
registered here as its fast_path "vllm". Nothing here imports vLLM until it is used."""
from __future__ import annotations

from rollout_service.engine.fast_path.registry import register_fast_path


def _vllm_proposer(model, **options):
    from rollout_service.vllm.proposer import VLLMProposer
    return VLLMProposer(model, **options)


register_fast_path("vllm", _vllm_proposer)
