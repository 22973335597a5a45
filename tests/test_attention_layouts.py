"""Attention: whole pass == token-by-token decode == random chunking == paged with shuffled blocks."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels as K
from conftest import assert_bitwise_equal


def _qkv(b, t, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: (torch.randn(b, t, h, d, generator=g)).to(torch.bfloat16)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _paged(k, block_size, seed):
    """Scatter contiguous [B, L, H, D] into a pool with a shuffled block table."""
    b, length = k.shape[:2]
    nb = -(-length // block_size)
    ids = list(range(b * nb + 3))
    random.Random(seed).shuffle(ids)
    table = torch.tensor(ids[:b * nb]).reshape(b, nb).int()
    pool = torch.randn(len(ids), block_size, *k.shape[2:]).to(torch.bfloat16)  # stale garbage
    padded = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, nb * block_size - length))
    pool[table.long()] = padded.reshape(b, nb, block_size, *k.shape[2:])
    return pool, table


@settings(max_examples=10, deadline=None, derandomize=True)
@given(t=st.integers(1, 45), heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]), d=st.sampled_from([8, 16]),
       b=st.integers(1, 3), block=st.sampled_from([4, 16]), seed=st.integers(0, 10**6))
def test_attention_layout_and_chunking_invariance(t, heads, d, b, block, seed):
    q, k, v = _qkv(b, t, *heads, d, seed)
    pos = torch.arange(t).expand(b, t)
    whole = K.attention(q, k, v, pos)
    # token-by-token decode: query t sees cache[:t+1]
    for i in range(t):
        step = K.attention(q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1], pos[:, i:i + 1])
        assert_bitwise_equal(step[:, 0], whole[:, i], f"decode step {i}")
    # random chunking over a longer contiguous buffer (keys beyond the chunk are invisible)
    rng = random.Random(seed)
    start = 0
    while start < t:
        stop = min(t, start + rng.randint(1, 8))
        chunk = K.attention(q[:, start:stop], k, v, pos[:, start:stop])
        assert_bitwise_equal(chunk, whole[:, start:stop], f"chunk {start}:{stop}")
        start = stop
    # paged, shuffled block table, garbage in unused slots
    kp, table = _paged(k, block, seed)
    vp, _ = _paged(v, block, seed)
    paged = K.attention(q, kp, vp, pos, block_table=table)
    assert_bitwise_equal(paged, whole, "paged")


def test_attention_rows_do_not_depend_on_batch_neighbours():
    q, k, v = _qkv(5, 30, 4, 2, 16, seed=1)
    lens = [30, 3, 17, 1, 25]
    pos = torch.stack([torch.where(torch.arange(30) < n, torch.arange(30), -1) for n in lens])
    batched = K.attention(q, k, v, pos)
    for i, n in enumerate(lens):
        alone = K.attention(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], pos[i:i + 1, :n])
        assert_bitwise_equal(alone[0], batched[i, :n], f"sequence {i}")
        assert bool((batched[i, n:] == 0).all()), "padding rows must be zero"


def test_attention_packed_rows_equal_the_padded_layout():
    """vLLM's flat token batch: query pieces of several sequences back to back (chunks, single decode
    tokens, in no particular order) attend in place over a paged cache; each row has the padded
    layout's bits and rows of no sequence are left as they were."""
    q, k, v = _qkv(3, 40, 4, 2, 16, seed=3)
    lens = [40, 31, 12]
    pos = torch.stack([torch.where(torch.arange(40) < n, torch.arange(40), -1) for n in lens])
    whole = K.attention(q, k, v, pos)
    kp, table = _paged(k, 4, seed=3)
    vp, _ = _paged(v, 4, seed=3)
    for pieces in ([(2, 3, 12), (0, 30, 40), (1, 0, 7)], [(1, 30, 31), (0, 39, 40), (2, 11, 12)]):
        rows = [(i, t) for i, s, e in pieces for t in range(s, e)] + [(0, 0)] * 2  # 2 padding rows
        seqs, ts = (torch.tensor(x) for x in zip(*rows))
        n = torch.tensor([e - s for _, s, e in pieces])
        starts = torch.cumsum(n, 0) - n
        out = torch.full((len(rows), 4, 16), float("nan"), dtype=torch.bfloat16)
        K.attention_packed(q[seqs, ts], kp, vp, pos[seqs, ts], table[[i for i, _, _ in pieces]], starts, n,
                           int(n.max()), out=out)
        for (i, s, e), start in zip(pieces, starts.tolist()):
            assert_bitwise_equal(out[start:start + e - s], whole[i, s:e], f"piece {(i, s, e)}")
        assert out[-2:].isnan().all(), "rows of no sequence must be left as they were"
    with pytest.raises(ValueError, match="same B sequences"):
        K.attention_packed(q[0], kp, vp, pos[0], table, starts[:2], n[:2], 10)


def test_attention_is_close_to_sdpa():
    q, k, v = _qkv(2, 33, 4, 2, 16, seed=5)
    out = K.attention(q, k, v, torch.arange(33).expand(2, 33)).float()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.repeat_interleave(2, 2).transpose(1, 2).float(),
        v.repeat_interleave(2, 2).transpose(1, 2).float(), is_causal=True).transpose(1, 2)
    assert torch.allclose(out, ref, atol=2e-2)


def test_attention_start_block_matters():
    """Negative control: visiting KV blocks from a different origin changes the bits, so the
    layout tests above could fail if a path did not start its blocks at position 0."""
    from kernels.reference.ops import attention
    q, k, v = _qkv(1, 40, 4, 4, 16, seed=9)
    pos = torch.arange(40).expand(1, 40)
    a = attention(q, k, v, pos, block_kv=16)
    b = attention(q, k, v, pos, block_kv=8)
    assert not torch.equal(a, b)


def test_attention_bad_input():
    q, k, v = _qkv(1, 4, 4, 2, 8, seed=0)
    pos = torch.arange(4).expand(1, 4)
    with pytest.raises(TypeError):
        K.attention(q.float(), k, v, pos)
    with pytest.raises(ValueError):
        K.attention(q, k, v, pos[:, :2])
    with pytest.raises(ValueError):
        K.attention(q[:, :, :3], k, v, pos)
    from kernels.reference.ops import attention
    with pytest.raises(ValueError, match="split_kv"):  # a split must hold whole KV blocks
        attention(q, k, v, pos, block_kv=16, split_kv=24)
