"""vLLM: the plugin that makes vLLM serve the canonical model (plugin/), VLLMEngine (a rollout
worker's engine on vLLM), VLLMInstance (one vllm.LLM) and the vLLM proposer for the native engine.
Nothing here imports vLLM until it is used."""
