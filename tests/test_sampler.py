"""Seeded Gumbel sampler: batch-independent, seed-sensitive, and distributed as softmax(logits / T)."""
import pytest
import torch

from kernels import sample
from kernels.sampling import allowed_mask, hash_uniform


def _args(n, temperature=1.0, top_k=-1, top_p=1.0, seeds=None, positions=None):
    return (torch.full((n,), float(temperature)), torch.full((n,), top_k), torch.full((n,), float(top_p)),
            torch.arange(n) if seeds is None else seeds, torch.zeros(n, dtype=torch.long) if positions is None
            else positions)


def test_same_seed_and_position_same_token_whatever_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 500, generator=g)
    seeds = torch.randint(0, 2**62, (64,), generator=g)
    positions = torch.randint(0, 4096, (64,), generator=g)
    for temp, k, p in [(0.7, -1, 0.9), (1.0, 20, 1.0), (1.3, 5, 0.5), (0.0, -1, 1.0)]:
        full = sample(logits, *_args(64, temp, k, p, seeds, positions))
        for bsz in (1, 4, 16):
            for start in range(0, 64, bsz):
                sl = slice(start, start + bsz)
                part = sample(logits[sl], *[a[sl] for a in _args(64, temp, k, p, seeds, positions)])
                assert torch.equal(part, full[sl])


def test_different_seeds_and_positions_give_different_samples():
    logits = torch.zeros(200, 1000)  # uniform: the noise alone decides
    by_seed = sample(logits, *_args(200, seeds=torch.arange(200)))
    by_pos = sample(logits, *_args(200, seeds=torch.zeros(200, dtype=torch.long), positions=torch.arange(200)))
    assert len(set(by_seed.tolist())) > 150 and len(set(by_pos.tolist())) > 150


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    assert sample(logits, *_args(2, temperature=0.0)).tolist() == [1, 0]


@pytest.mark.parametrize("temp", [0.7, 1.0, 1.5])
def test_empirical_frequencies_match_softmax(temp):
    """Chi-square goodness of fit over 40,000 seeds (critical value for 7 dof at p=0.001: 24.3)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 40_000
    tokens = sample(logits.expand(n, -1), *_args(n, temp, seeds=torch.arange(n) * 7919 + 13))
    observed = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits.double() / temp, -1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, chi2


def test_chi_square_rejects_a_wrong_distribution():
    """The bound above can fail: the same samples against softmax at the wrong temperature."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 40_000
    tokens = sample(logits.expand(n, -1), *_args(n, 1.0, seeds=torch.arange(n) * 7919 + 13))
    observed = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits.double() / 1.2, -1) * n
    assert float(((observed - expected) ** 2 / expected).sum()) > 24.3


def test_top_k_top_p_masks():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0]])
    assert allowed_mask(logits, torch.tensor([2]), torch.tensor([1.0])).tolist() == [[False, True, False, True, False]]
    assert allowed_mask(logits, torch.tensor([3]), torch.tensor([1.0])).tolist() == [[False, True, False, True, True]]
    # top_p tiny keeps exactly the best id (lowest id among ties)
    assert allowed_mask(logits, torch.tensor([-1]), torch.tensor([1e-6])).tolist() == [[False, True, False, False, False]]
    n = 2000
    toks = sample(logits.expand(n, -1), *_args(n, 1.0, top_k=2, seeds=torch.arange(n)))
    assert set(toks.tolist()) == {1, 3}


def test_hash_is_uniform_and_in_open_interval():
    u = hash_uniform(torch.arange(100), torch.arange(100), 1000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("bad", [
    dict(temperature=torch.tensor([-1.0])), dict(top_p=torch.tensor([0.0])), dict(top_p=torch.tensor([1.5])),
    dict(positions=torch.tensor([-3])), dict(seeds=torch.tensor([1, 2]))])
def test_bad_sampler_arguments_raise(bad):
    args = dict(temperature=torch.tensor([1.0]), top_k=torch.tensor([-1]), top_p=torch.tensor([1.0]),
                seeds=torch.tensor([1]), positions=torch.tensor([0]))
    args.update(bad)
    with pytest.raises(ValueError):
        sample(torch.randn(1, 10), **args)
    with pytest.raises(ValueError):
        sample(torch.randn(10), torch.tensor([1.0]), torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([1]),
               torch.tensor([0]))


@pytest.mark.parametrize("bad", [dict(temperature=[-0.5]), dict(temperature=[float("nan")]), dict(top_p=[0.0]),
                                 dict(top_p=[1.5]), dict(position=[-1]), dict(seed=[1, 2])])
def test_row_params_refuse_bad_values_when_built(bad):
    from rollout_service.engine.sampler import RowParams
    values = dict(temperature=[1.0], top_k=[0], top_p=[1.0], seed=[3], position=[7])
    values.update(bad)
    with pytest.raises(ValueError):
        RowParams.from_values(**values)


def test_row_params_sample_as_the_rule_does():
    """sample_tokens (host arrays, one staged copy) picks what kernels.sample picks for the same rows."""
    from rollout_service.engine.sampler import RowParams, sample_tokens
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 2
    values = ([0.0, 0.7, 1.0, 1.3], [0, 5, 0, 0], [1.0, 1.0, 0.9, 1.0], [1, 2, 3, 2 ** 40], [5, 9, 0, 11])
    rows = RowParams.from_values(*values)
    expected = sample(logits, *(torch.tensor(v) for v in values))
    assert torch.equal(sample_tokens(logits, rows), expected)
    assert not torch.equal(sample_tokens(logits, rows.with_seeds(rows.seed + 1)), expected)
