"""The native DVR engine: the scheduler plans each step, a fast path proposes tokens, the verifier
runs the canonical forward over them and commits; the runner, KV cache and sampler serve all three.
protocol.py is what every rollout engine provides (this one, tp/'s and rollout_service.vllm's)."""
