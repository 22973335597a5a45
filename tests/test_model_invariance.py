"""Whole models (tiny Llama, Qwen2, Qwen3): canonical log-probs are invariant; the unpatched path is not."""
import pytest
import torch

import trainer_patch
from conftest import assert_bitwise_equal
from kernels.forward import PagedKV, compute_logits, forward_hidden, model_spec
import kernels as K
from rollout_service.tiny_models import tiny_model

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return trainer_patch.patch_model(tiny_model(request.param, seed=1))


def _seqs(lengths, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _padded(seqs):
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return ids, mask


def test_logprobs_alone_equal_logprobs_in_padded_batches(model):
    seqs = _seqs([23, 5, 40, 12, 31, 2, 17])
    alone = [trainer_patch.token_logprobs(model, s[None]) for s in seqs]
    for order in ([0, 1, 2, 3, 4, 5, 6], [6, 2, 0, 5], [3, 0]):
        ids, mask = _padded([seqs[i] for i in order])
        batch = trainer_patch.token_logprobs(model, ids, mask)
        for row, i in enumerate(order):
            n = len(seqs[i]) - 1
            assert_bitwise_equal(batch[row, :n], alone[i][0], f"seq {i} in batch {order}")
            assert bool((batch[row, n:] == 0).all())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_incremental_with_paged_kv_cache_equal_whole_pass(model, temperature):
    seq = _seqs([37], seed=3)[0]
    whole = trainer_patch.token_logprobs(model, seq[None], temperature=temperature)[0]
    spec = model_spec(model)
    bs = 8
    pools = lambda: [torch.zeros(12, bs, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16)  # noqa: E731
                     for _ in range(spec.num_layers)]
    k_pools, v_pools = pools(), pools()
    table = torch.tensor([[7, 2, 9, 0, 11]], dtype=torch.int32)  # out-of-order blocks
    got = []
    with torch.no_grad():
        for start, stop in [(0, 1), (1, 9), (9, 10), (10, 24), (24, 25), (25, 36)]:
            pos = torch.arange(start, stop)[None]
            slots = table.long()[0, pos // bs] * bs + pos % bs
            kv = PagedKV(k_pools, v_pools, table, slots)
            hidden = forward_hidden(model, seq[None, start:stop], pos, kv=kv)
            logits = K.scale_logits(compute_logits(model, hidden[0]), temperature)
            got.append(K.log_softmax(logits).gather(1, seq[start + 1:stop + 1, None])[:, 0])
    assert_bitwise_equal(torch.cat(got), whole, "incremental")


def test_patched_model_is_close_to_unpatched():
    for arch in ARCHS:
        ref = tiny_model(arch, seed=2)
        ids = _seqs([30], seed=4)[0][None]
        with torch.no_grad():
            expected = torch.log_softmax(ref(input_ids=ids).logits.float(), -1)
            got = torch.log_softmax(trainer_patch.patch_model(ref)(input_ids=ids).logits, -1)
        assert (got - expected).abs().max() < 0.08, arch


def test_negative_control_unpatched_model_is_not_invariant_on_cpu():
    """Measured on CPU: the unpatched HF model (SDPA attention) gives different log-probs for the
    same prefix depending on the sequence length."""
    model = tiny_model("qwen2", seed=1)
    g = torch.Generator().manual_seed(5)
    differing = 0
    with torch.no_grad():
        for _ in range(10):
            ids = torch.randint(0, 96, (1, 64), generator=g)
            full = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
            for length in (8, 20, 33, 50):
                prefix = torch.log_softmax(model(input_ids=ids[:, :length]).logits.float(), -1)
                differing += not torch.equal(full[:, :length], prefix)
    assert differing > 0, "unpatched prefix log-probs never changed with the sequence length"
    # the canonical forward on the same inputs is invariant
    patched = trainer_patch.patch_model(tiny_model("qwen2", seed=1))
    a = trainer_patch.token_logprobs(patched, ids)[:, :19]  # last ids from the loop above
    assert_bitwise_equal(a, trainer_patch.token_logprobs(patched, ids[:, :20]), "canonical prefix")
