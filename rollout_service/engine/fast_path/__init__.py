"""The proposers' interface (base) and the native fast path's ordinary torch ops (native_ops)."""
