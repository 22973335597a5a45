"""The parts of `python -m bench.vllm_step_profile`: one module per way of looking at a generate."""
