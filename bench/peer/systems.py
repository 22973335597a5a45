"""The systems `bench.peer_vllm` can run, which of them share a process under --interleave, and the
GPU memory they ask for together."""
from __future__ import annotations

DEFAULT_SYSTEMS = ("vllm", "vllm-batch-invariant", "ours-verified")
ALL_SYSTEMS = DEFAULT_SYSTEMS + ("ours-invariant", "ours-off", "vllm-plugin", "vllm-plugin-eager", "vllm-plugin-v1",
                                 "vllm-plugin-gather", "vllm-plugin-scatter",
                                 "vllm-eager", "vllm-v1",
                                 "native-verified", "native-invariant", "native-off", "worker-verified", "worker-off",
                                 "worker-off-own-process")
# --interleave: these systems can share one process (no process-wide setting of their own, TP = 1)
INTERLEAVABLE = ("vllm", "vllm-eager", "vllm-plugin", "vllm-plugin-eager", "worker-off")
INTERLEAVED_GPU_SHARE = 0.9  # --interleave on a GPU: what the process's engines may ask for together
# the worker's off builds VLLMEngine's canonical engine beside the stock one that serves it, each with
# the vllm system's memory share
WORKER_OFF_ENGINES = 2
INTERLEAVED = "interleaved:"  # the worker name of an interleaved process, its systems after it
TEARDOWN_GRACE_S = 60  # a system's process gets this long to exit once it has printed its result
TINY_KW = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)  # head_dim 32


def interleaved_gpu_share(systems: list[str], share: float) -> float:
    """The GPU memory share an interleaved process's engines ask for together: `share` per engine,
    and worker-off builds two (VLLMEngine's canonical engine beside the stock one it serves off on)."""
    return share * sum(WORKER_OFF_ENGINES if system == "worker-off" else 1 for system in systems)
