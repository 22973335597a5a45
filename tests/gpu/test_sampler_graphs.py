"""GPU: the sampling rule and token log-probs replayed from CUDA graphs (rollout_service.vllm.sampler_graphs)
equal the eager rule bit for bit, for row counts that fill a bucket and ones that pad it, call after
call with new logits and params (a replay reads this step's inputs, not the capture's)."""
import numpy as np
import pytest
import torch

from kernels.logprobs import token_logprobs
from rollout_service.engine.sampler import RowParams, sample_tokens

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from rollout_service.vllm.sampler_graphs import SamplerGraphs  # noqa: E402

VOCAB = 50_000


def _rows(n, seed):
    rng = np.random.default_rng(seed)
    temperature = rng.choice(np.array([0.0, 0.7, 1.0], np.float32), n)
    return RowParams.from_values(temperature, [0] * n, [1.0] * n, rng.integers(0, 2 ** 40, n),
                                 rng.integers(0, 9000, n))


def _eager(logits, rows):
    tokens = sample_tokens(logits, rows)
    return tokens, token_logprobs(logits, torch.from_numpy(rows.temperature), tokens)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_replays_equal_the_eager_rule():
    graphs = SamplerGraphs(256, VOCAB, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    # the first call of a bucket runs eagerly and captures; later calls replay, interleaved across buckets
    for step, n in enumerate((3, 64, 3, 1, 200, 64, 4, 256, 3, 200)):
        logits = torch.randn(n, VOCAB, generator=g, device="cuda") * 4
        rows = _rows(n, step)
        assert graphs.covers(logits, rows)
        tokens, logprobs = graphs(logits, rows)
        want_tokens, want_logprobs = _eager(logits, rows)
        assert torch.equal(tokens, want_tokens), (step, n)
        assert torch.equal(_bits(logprobs), _bits(want_logprobs)), (step, n)
    assert sorted(graphs.graphs) == [1, 4, 64, 256]


def test_replay_reads_new_params():
    """The control: a sampled row's token follows its seed through the replay (the params are copied in
    each call); with a stale copy the replay would repeat the captured call's tokens."""
    graphs = SamplerGraphs(8, VOCAB, "cuda")
    logits = torch.zeros(5, VOCAB, device="cuda")  # flat logits: the seed alone picks the token
    sampled = RowParams.from_values([1.0] * 5, [0] * 5, [1.0] * 5, [1, 2, 3, 4, 5], [10] * 5)
    first = graphs(logits, sampled)[0]
    again = graphs(logits, sampled)[0]
    other = graphs(logits, sampled.with_seeds(np.array([6, 7, 8, 9, 10])))[0]
    assert torch.equal(first, again)
    assert (other != first).all()
    assert torch.equal(other, _eager(logits, sampled.with_seeds(np.array([6, 7, 8, 9, 10])))[0])


def test_masked_or_foreign_rows_are_not_covered():
    graphs = SamplerGraphs(8, VOCAB, "cuda")
    logits = torch.zeros(2, VOCAB, device="cuda")
    two = RowParams.from_values([1.0, 1.0], [0, 0], [1.0, 1.0], [1, 2], [0, 0])
    assert graphs.covers(logits, two)
    assert not graphs.covers(logits, RowParams.from_values([1.0, 1.0], [20, 0], [1.0, 1.0], [1, 2], [0, 0]))
    assert not graphs.covers(logits, RowParams.from_values([1.0, 1.0], [0, 0], [1.0, 0.9], [1, 2], [0, 0]))
    assert not graphs.covers(logits.bfloat16(), two)
    assert not graphs.covers(torch.zeros(2, VOCAB + 1, device="cuda"), two)
    nine = RowParams.from_values([1.0] * 9, [0] * 9, [1.0] * 9, range(9), [0] * 9)
    assert not graphs.covers(torch.zeros(9, VOCAB, device="cuda"), nine)  # more rows than max_rows


def test_head_graphs_give_the_eager_logits_and_the_rule_reads_them_in_place():
    """compute_logits replays the lm_head product per bucket into the buffer the rule's graphs read:
    the eager product's bits at every row count (padded buckets included), new hidden rows each call
    (a stale replay would repeat the capture's logits), and the rule on them equal to the eager rule."""
    import kernels as K

    graphs = SamplerGraphs(64, VOCAB, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    weight = (torch.randn(VOCAB, 256, generator=g, device="cuda") * 0.05).bfloat16()

    def head(hidden):
        return K.matmul(hidden, weight, out_dtype=torch.float32)
    for step, n in enumerate((5, 64, 5, 1, 33, 64, 5)):
        hidden = torch.randn(n, 256, generator=g, device="cuda").bfloat16()
        logits = graphs.compute_logits(hidden, head)
        want = head(hidden)
        assert graphs.holds(logits) and logits.shape == (n, VOCAB)
        assert torch.equal(_bits(logits), _bits(want)), (step, n)
        rows = _rows(n, step)
        tokens, logprobs = graphs(logits, rows)
        want_tokens, want_logprobs = _eager(want, rows)
        assert torch.equal(tokens, want_tokens), (step, n)
        assert torch.equal(_bits(logprobs), _bits(want_logprobs)), (step, n)
    assert sorted(graphs.head_graphs) == [1, 8, 64]
    # more rows than the graphs hold, or a capture under way: the caller computes them eagerly
    assert graphs.compute_logits(torch.zeros(65, 256, device="cuda", dtype=torch.bfloat16), head) is None
    two = torch.zeros(2, 256, device="cuda", dtype=torch.bfloat16)
    capture = torch.cuda.CUDAGraph()
    with torch.cuda.graph(capture):
        two.zero_()  # (a graph with no work in it draws a warning)
        inside = graphs.compute_logits(two, head)
    assert inside is None


def test_params_staged_in_turn_follow_every_call():
    """The parameter buffers are reused in turn; more calls than buffers, each with new seeds, still
    sample from that call's seeds (the control: the same seeds repeat their tokens)."""
    graphs = SamplerGraphs(8, VOCAB, "cuda")
    logits = torch.zeros(6, VOCAB, device="cuda")  # flat logits: the seed alone picks the token
    seen = []
    for call in range(11):
        rows = RowParams.from_values([1.0] * 6, [0] * 6, [1.0] * 6, np.arange(6) + 100 * (call % 5), [7] * 6)
        tokens = graphs(logits, rows)[0]
        assert torch.equal(tokens, _eager(logits, rows)[0]), call
        seen.append(tokens.tolist())
    assert seen[0] == seen[5] == seen[10] and seen[0] != seen[1]
