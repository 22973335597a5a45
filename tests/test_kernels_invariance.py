"""Per-row bitwise invariance of every canonical op across batch sizes, row positions and chunkings."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels as K
from conftest import assert_bitwise_equal

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


def _bf16(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@SETTINGS
@given(k=st.integers(1, 96), n=st.integers(1, 40), batch=st.integers(1, 64), seed=st.integers(0, 10**6),
       row_parallel=st.booleans())
def test_matmul_rows_do_not_depend_on_batch(k, n, batch, seed, row_parallel):
    x, w = _bf16(batch, k, seed=seed), _bf16(n, k, seed=seed + 1)
    full = K.matmul(x, w, row_parallel=row_parallel)
    for i in {0, batch // 2, batch - 1}:
        assert_bitwise_equal(K.matmul(x[i:i + 1], w, row_parallel=row_parallel)[0], full[i], f"row {i}")
    perm = torch.randperm(batch, generator=torch.Generator().manual_seed(seed))
    assert_bitwise_equal(K.matmul(x[perm], w, row_parallel=row_parallel), full[perm], "permuted rows")


def test_matmul_segment_tree_is_not_plain_order():
    # the tree changes the rounding (that is what makes TP invariant), so it must differ somewhere
    x, w = _bf16(64, 512, seed=3), _bf16(64, 512, seed=4)
    assert not torch.equal(K.matmul(x, w, out_dtype=torch.float32),
                           K.matmul(x, w, row_parallel=True, out_dtype=torch.float32))


@SETTINGS
@given(h=st.integers(1, 200), batch=st.integers(1, 64), seed=st.integers(0, 10**6))
def test_rms_norm_and_silu_rows_do_not_depend_on_batch(h, batch, seed):
    x, w = _bf16(batch, h, seed=seed), _bf16(h, seed=seed + 1)
    full = K.rms_norm(x, w, 1e-6)
    act = K.silu_mul(x, x.flip(0))
    for i in {0, batch - 1}:
        assert_bitwise_equal(K.rms_norm(x[i:i + 1], w, 1e-6)[0], full[i], "rms_norm")
        assert_bitwise_equal(K.silu_mul(x[i:i + 1], x.flip(0)[i:i + 1])[0], act[i], "silu_mul")


@SETTINGS
@given(v=st.integers(2, 3000), batch=st.integers(1, 64), seed=st.integers(0, 10**6))
def test_log_softmax_rows_do_not_depend_on_batch(v, batch, seed):
    x = torch.randn(batch, v, generator=torch.Generator().manual_seed(seed)) * 4
    full = K.log_softmax(x)
    for i in {0, batch // 3, batch - 1}:
        assert_bitwise_equal(K.log_softmax(x[i:i + 1])[0], full[i], "log_softmax")
    assert torch.allclose(full, torch.log_softmax(x, -1), atol=2e-6, rtol=0)


def test_exact_math_matches_torch_closely():
    from kernels.reference import exact_math as em
    x = torch.linspace(-80, 80, 100_001)
    assert torch.allclose(em.exp(x), torch.exp(x), rtol=3e-7, atol=0)
    y = torch.rand(100_000) * 1e4 + 1e-20
    assert torch.allclose(em.log(y), torch.log(y), rtol=0, atol=1e-6)


@SETTINGS
@given(batch=st.integers(1, 12), seq=st.integers(1, 40), chunk=st.integers(1, 40), seed=st.integers(0, 10**6))
def test_ops_rows_do_not_depend_on_chunking(batch, seq, chunk, seed):
    """A sequence processed in chunks gives the same per-token rows as processed whole."""
    x, w = _bf16(batch * seq, 48, seed=seed), _bf16(24, 48, seed=seed + 1)
    whole = K.matmul(x, w)
    parts = torch.cat([K.matmul(x[i:i + chunk], w) for i in range(0, x.shape[0], chunk)])
    assert_bitwise_equal(parts, whole, "matmul chunked")
