"""Transcendentals and reductions built only from correctly rounded IEEE operations.

torch's own CPU `exp`/`log`/`sum` pick different code paths (SIMD body, scalar tail, thread chunk)
depending on where an element sits in a tensor, so their result for one row can depend on the size of
the batch around it. Every function here is a fixed sequence of elementwise +, -, *, /, sqrt, integer
bit operations, comparisons and exact max/min: each result depends only on the element's own inputs.
"""
from __future__ import annotations

import torch

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # few mantissa bits: n * _LN2_HI is exact for |n| < 2**8
_LN2_LO = 1.4286068203094172e-06
_EXP_COEFFS = [1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0]  # Taylor, high to low
_SQRT2 = 1.4142135623730951


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2**n for integral float32 n in [-126, 127], built from the exponent bits (exact)."""
    bits = (n.to(torch.int32) + 127) << 23
    return bits.view(torch.float32)


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp for float32 via Cody-Waite range reduction and a Horner polynomial (< 2 ulp)."""
    x = x.clamp(-104.0, 88.5)
    n = torch.round(x * _LOG2E)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r + c
    half = torch.floor(n * 0.5)
    return (p * _pow2(half)) * _pow2(n - half)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log for float32 x > 0 (0 -> -inf, negative -> nan, inf -> inf)."""
    tiny = x < 1.1754943508222875e-38
    xs = torch.where(tiny, x * 16777216.0, x)  # lift subnormals into the normal range
    bits = xs.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - torch.where(tiny, 24, 0)
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # mantissa in [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    e = (e + big.to(torch.int32)).to(torch.float32)
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    poly = torch.full_like(z, 2.0 / 11.0)
    for c in (2.0 / 9.0, 2.0 / 7.0, 2.0 / 5.0, 2.0 / 3.0):
        poly = poly * z + c
    log_m = s * 2.0 + s * (z * poly)
    out = e * _LN2_HI + (log_m + e * _LN2_LO)
    out = torch.where(x == 0, float("-inf"), out)
    out = torch.where(torch.isinf(x) & (x > 0), float("inf"), out)
    return torch.where(x < 0, float("nan"), out)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (exp(-x) + 1.0)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed pairwise tree (length zero-padded to a power of two)."""
    n = x.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        x = torch.nn.functional.pad(x, (0, size - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def tree_combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Add equally shaped partials by a fixed binary tree ((p0+p1)+(p2+p3))+...; len must be 2**k."""
    if len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_combine needs a power-of-two number of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]
