"""The content digest of weights, which the trainer and every worker compare.

It is computed where the weights are (CPU or GPU) and gives the same value on every device: each
tensor's bf16 bits go through exact integer arithmetic only, so no reduction order can change it. Per
tensor, two 31-bit lanes (a "fingerprint") are sums of the bits weighted by pseudo-random position
weights; the state dict's digest hashes the names, shapes and fingerprints in name order on the host
(a few bytes per tensor). It guards against wrong, stale, truncated or corrupted weights, not against
an adversary.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Iterable, Mapping

import torch

_P = 2 ** 31 - 1  # lane modulus (a prime)
_ROW = 1 << 14  # elements per row
_LANE_SEEDS = (0x2545F491, 0x61C88647)
_CHUNK_ROWS = 1024  # rows per host matmul: 16M elements, a 128 MiB float64 temporary
_row_weights: dict[torch.device, torch.Tensor] = {}


def _position_weights(index: torch.Tensor, seed: int, bits: int = 20) -> torch.Tensor:
    """Pseudo-random weights in [1, 2**bits] for int64 positions (exact integer math on any device)."""
    x = (index * 48271 + seed) % _P
    x = (x * x + 12345) % _P  # x < 2**31, so x * x < 2**62 fits int64
    x = (x * x + 67891) % _P
    return (x & ((1 << bits) - 1)) + 1


def _weights_in_row(device: torch.device) -> torch.Tensor:
    """[2, _ROW] int32: each lane's weights (in [1, 2**14]) for the positions inside one row."""
    w = _row_weights.get(device)
    if w is None:
        pos = torch.arange(_ROW, device=device, dtype=torch.int64)
        w = torch.stack([_position_weights(pos, s, bits=14) for s in _LANE_SEEDS]).to(torch.int32)
        _row_weights[device] = w
    return w


_rows_weights: dict[torch.device, torch.Tensor] = {}


def _weights_of_rows(device: torch.device, rows: int) -> torch.Tensor:
    """[>= rows, 2] int64: each lane's weights for row positions 0..rows-1, kept per device and grown
    by doubling (a push fingerprints hundreds of tensors: their row weights are computed once)."""
    w = _rows_weights.get(device)
    if w is None or w.shape[0] < rows:
        index = torch.arange(max(rows, 2 * (0 if w is None else w.shape[0]), 1024), device=device, dtype=torch.int64)
        w = torch.stack([_position_weights(index, seed) for seed in _LANE_SEEDS], dim=1)
        _rows_weights[device] = w
    return w[:rows]


def tensor_fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two 31-bit lanes over `t`'s bf16 bits and their positions; equal on every device."""
    return fingerprints([t])[0]


def fingerprints(tensors) -> list[tuple[int, int]]:
    """tensor_fingerprint of each tensor (packed_rows: one wait for the device, not one per tensor)."""
    return [(a, b) for a, b, _ in packed_rows(tensors)]


PACK_BYTES = 256 << 20  # packed_rows' bf16 buckets on a GPU


def packed_rows(tensors: Iterable[torch.Tensor], bucket_bytes: int = PACK_BYTES) -> list[list[int]]:
    """[lane a, lane b, count of non-finite values] of each tensor, in order (packed_fingerprints' rows).
    On a GPU the tensors are copied into bf16 buckets of `bucket_bytes` and each bucket is fingerprinted in
    one pass: a few launches per bucket, not per tensor (a push, or an adapter, has hundreds of tensors). On
    the host each tensor is read where it is. A tensor may be freed once the next is asked for (FSDP gathers
    them one at a time): it has been copied or read; the device is waited for once, at the end."""
    cap = max(1, int(bucket_bytes) // 2)
    results, buf, layout, used = [], None, [], 0
    for t in tensors:
        n = t.numel()
        if layout and (used + n > cap or buf.device != t.device):  # the bucket is full: fingerprint it
            results.append(packed_fingerprints(buf, layout))
            layout, used = [], 0
        if _triton_row_sums(t.device) is None or n > cap:  # the host, or a bucket of its own: where it is
            results.append(packed_fingerprints(t, [(0, n)]))
            continue
        if buf is None or buf.device != t.device:
            buf = torch.empty(cap, dtype=torch.bfloat16, device=t.device)
        buf[used:used + n].copy_(t.detach().reshape(-1))  # rule: after the last bucket's pass on this stream
        layout.append((used, n))
        used += n
    if layout:
        results.append(packed_fingerprints(buf, layout))
    return [[int(x) for x in row] for part in results for row in part.tolist()]


def fingerprint_lanes(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint's two lanes as an int64 tensor on `t`'s device (no wait for the device)."""
    if _triton_row_sums(t.device) is None:  # the host: no non-finite count (check_finite is its own pass)
        return _host_lanes(_bf16_bits(t), _weights_in_row(t.device))
    return packed_fingerprints(t, [(0, t.numel())])[0, :2]


def _bf16_bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return (flat if flat.dtype == torch.bfloat16 else flat.to(torch.bfloat16)).view(torch.int16)


def packed_fingerprints(buf: torch.Tensor, layout: Iterable[tuple[int, int]]) -> torch.Tensor:
    """[len(layout), 3] int64 on `buf`'s device, one row per tensor packed in `buf` (flattened to bf16)
    at (offset, numel): its fingerprint's two lanes and its count of non-finite values; no wait for
    the device.

    An element contributes its 16 bits read as a signed integer plus 2**15 + 1 (a number in
    [1, 2**16]: every bit pattern counts, all-zero bits too) times its in-row weight (in [1, 2**14]),
    summed per row of 2**14 elements of its tensor. Every product is below 2**31 and every row sum
    below 2**45, an integer that float64 and int64 both hold exactly whatever order they add in: the
    host sums rows with a float64 matmul, CUDA with one Triton launch for all the rows of the buffer
    (kernels.triton.fingerprint), and the two agree bit for bit. The row sums are reduced modulo a
    prime, weighted by their row's position in its tensor and summed in int64 (exact, order-free)."""
    layout = tuple((int(o), int(n)) for o, n in layout)
    bits = _bf16_bits(buf)
    w = _weights_in_row(bits.device)
    kernel = _triton_row_sums(bits.device)
    if kernel is None:  # the host: each tensor's rows with float64 matmuls, a chunk of rows at a time
        flat = bits.view(torch.bfloat16)
        rows = [torch.cat([_host_lanes(bits[o:o + n], w), (~torch.isfinite(flat[o:o + n])).sum().view(1)])
                for o, n in layout]
        return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.int64)
    starts, lengths, row_in_tensor, tensor_index = _row_table(bits.device, layout)
    # Triton launches on the current device, which may be another GPU than the buffer's
    with torch.cuda.device(bits.device) if bits.is_cuda else contextlib.nullcontext():
        sums = kernel(bits, starts, lengths, w)  # [R, 3]
    weighted = (sums[:, :2] % _P * _weights_of_rows(bits.device, _max_rows(layout))[row_in_tensor]) % _P
    out = torch.zeros(len(layout), 3, dtype=torch.int64, device=bits.device)
    out.index_add_(0, tensor_index, torch.cat([weighted, sums[:, 2:]], dim=1))  # integer sums: exact in any order
    out[:, :2] %= _P
    return out


def _host_lanes(bits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[2] int64: the fingerprint's lanes of one tensor's bits, on the host."""
    lanes = torch.zeros(2, dtype=torch.int64)
    step = _CHUNK_ROWS * _ROW
    for start in range(0, bits.numel(), step):
        rows = _host_row_sums(bits[start:start + step], w) % _P  # [R, 2] int64
        first = start // _ROW
        lanes += ((rows * _weights_of_rows(bits.device, first + rows.shape[0])[first:]) % _P).sum(dim=0)
    return lanes % _P


def _max_rows(layout: tuple[tuple[int, int], ...]) -> int:
    return max((-(-n // _ROW) for _, n in layout), default=0)


@functools.lru_cache(maxsize=256)  # a push's buckets have the same layouts every time
def _row_table(device: torch.device, layout: tuple[tuple[int, int], ...]):
    """Every row of every tensor in `layout`: (start in the buffer int64, length int32, index of the row
    in its tensor int64, index of its tensor int64), on `device`."""
    numels = torch.tensor([n for _, n in layout], dtype=torch.int64).reshape(-1)
    offsets = torch.tensor([o for o, _ in layout], dtype=torch.int64).reshape(-1)
    counts = -(-numels // _ROW)
    tensor_index = torch.repeat_interleave(torch.arange(len(layout)), counts)
    first_row = torch.cumsum(counts, 0) - counts
    row_in_tensor = torch.arange(int(counts.sum())) - first_row[tensor_index]
    starts = offsets[tensor_index] + row_in_tensor * _ROW
    lengths = torch.clamp(numels[tensor_index] - row_in_tensor * _ROW, max=_ROW).to(torch.int32)
    return tuple(x.to(device) for x in (starts, lengths, row_in_tensor, tensor_index))


def _triton_row_sums(device: torch.device):
    """kernels.triton.fingerprint.fingerprint_row_sums for CUDA tensors where Triton loads, else None."""
    return _triton_kernel() if device.type == "cuda" else None


@functools.cache  # asked once per tensor of a push: the import is tried once per process
def _triton_kernel():
    try:
        from kernels.triton.fingerprint import fingerprint_row_sums
    except ImportError:
        return None
    return fingerprint_row_sums


def _host_row_sums(bits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[ceil(n / _ROW), 2] int64: each row's sum of (bits + 2**15 + 1) * in-row weight, per lane."""
    s = bits.to(torch.float64)
    wf = w.to(torch.float64).T  # [_ROW, 2]
    full = s.numel() // _ROW * _ROW
    # (s + 2**15 + 1) @ w = s @ w + (2**15 + 1) * sum(w)
    parts = [s[:full].view(-1, _ROW) @ wf + 32769.0 * wf.sum(0)] if full else []
    if full < s.numel():  # a last, partial row
        tail = wf[:s.numel() - full]
        parts.append((s[full:] @ tail + 32769.0 * tail.sum(0)).unsqueeze(0))
    return torch.cat(parts).to(torch.int64) if parts else torch.zeros(0, 2, dtype=torch.int64)


def digest_of_fingerprints(entries: Iterable[tuple[str, tuple, tuple[int, int]]]) -> str:
    """The digest of (name, shape, fingerprint) entries, taken in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name, shape, (a, b) in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}|{tuple(int(s) for s in shape)}|{a}|{b};".encode())
    return h.hexdigest()


def state_dict_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """The digest of a state dict's bf16 contents, computed on the tensors' own device(s)."""
    names = list(state_dict)
    prints = fingerprints([state_dict[n] for n in names])
    return digest_of_fingerprints((n, state_dict[n].shape, fp) for n, fp in zip(names, prints))


def model_digest(model: torch.nn.Module) -> str:
    return state_dict_digest(dict(model.state_dict()))
