"""Reference (plain torch) implementations of the canonical ops; see ops.py."""
from .ops import add, attention, log_softmax, matmul, matmul_partials, rms_norm, rotary, silu_mul, write_kv

__all__ = ["add", "attention", "log_softmax", "matmul", "matmul_partials", "rms_norm", "rotary", "silu_mul", "write_kv"]
