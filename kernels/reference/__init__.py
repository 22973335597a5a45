"""Reference (plain torch) implementations of the canonical ops; see ops.py."""
from .ops import (add, attention, attention_packed, log_softmax, lora_add, lora_expand_add, matmul, matmul_partials,
                  rms_norm, rotary, silu_mul, write_kv)

__all__ = ["add", "attention", "attention_packed", "log_softmax", "lora_add", "lora_expand_add", "matmul",
           "matmul_partials", "rms_norm", "rotary", "silu_mul", "write_kv"]
