"""The parts of `python -m bench.peer_vllm`: the systems, their engines, timed passes, one process per
system, and the report."""
