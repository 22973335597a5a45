"""The V2-runner sampler (rollout_service.vllm.plugin.runner_v2) on its own, with vLLM's sampler
stood in for: which rows it takes, the positions it hashes (prefix hits, chunked prefill, a client's
position offset), what it leaves vLLM to pick, and the log-prob it reports. vLLM's CPU build has no
V2 runner; the same sampler inside real vLLM is tests/gpu/test_vllm_plugin_gpu.py."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels import sample
from kernels.logprobs import token_logprobs
from rollout_service.vllm.plugin.runner_v2 import CanonicalSampler, RequestTable

VOCAB = 50


class RecordingBase:
    """vLLM's V2 sampler as far as ours relies on it: greedy over what it is given, log-prob column 0."""

    def __init__(self):
        self.seen = None
        self.sampling_states = "vLLM's"

    def __call__(self, logits, input_batch):
        self.seen = logits.clone()
        tokens = logits.argmax(-1)
        raw = torch.log_softmax(logits, -1).gather(1, tokens[:, None])
        # columns: the sampled token, then the top-1 (the same id: it is the only finite logit)
        return SimpleNamespace(sampled_token_ids=tokens[:, None], logprobs_tensors=SimpleNamespace(
            logprob_token_ids=torch.stack([tokens, tokens], 1), logprobs=torch.cat([raw, raw], 1)))


def _batch(state_idx, computed, scheduled):
    return SimpleNamespace(num_reqs=len(state_idx), idx_mapping_np=np.array(state_idx),
                           num_computed_tokens_np=np.array(computed), num_scheduled_tokens=np.array(scheduled))


def _table(requests: dict[int, tuple[dict, int]]) -> RequestTable:
    table = RequestTable(size=4)  # slots past 3 make it grow
    for slot, (cfg, prompt_len) in requests.items():
        table.set(slot, cfg, prompt_len)
    return table


def _expected(logits, cfg, position):
    token = sample(logits[None], torch.tensor([cfg["temperature"]]), torch.tensor([cfg["top_k"]]),
                   torch.tensor([cfg["top_p"]]), torch.tensor([cfg["seed"]]), torch.tensor([position]))
    return int(token), float(token_logprobs(logits[None], [cfg["temperature"]], token))


def test_rows_with_params_get_the_rule_at_their_positions_others_pass_through():
    cfg = lambda seed, t, pos: dict(seed=seed, temperature=t, top_k=0, top_p=1.0, position=pos)  # noqa: E731
    # state index -> (params, prompt length): a plain request (7), one whose client counts 100 tokens
    # before its prompt's end (position 100 for a 10-token prompt), a greedy one
    requests = {3: (cfg(11, 0.7, 12), 12), 5: (cfg(12, 1.0, 100), 10), 9: (cfg(13, 0.0, 4), 4)}
    base = RecordingBase()
    sampler = CanonicalSampler(base, _table(requests))
    assert sampler.sampling_states == "vLLM's"  # the runner reads the base sampler's state through ours
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    original = logits.clone()
    # rows: request 3 decoding its 6th token (12 + 5 before it), request 7, request 5 finishing its
    # prompt from a prefix hit (8 cached + 2 new), request 9 in a prefill chunk that does not end it
    out = sampler(logits, _batch([3, 7, 5, 9], [16, 30, 8, 0], [1, 1, 2, 2]))
    positions = {0: 12 + 5, 2: 100, 3: 4}  # the partial chunk's (discarded) sample hashes num_outputs 0
    for row, pos in positions.items():
        req = requests[[3, 7, 5, 9][row]][0]
        token, logprob = _expected(original[row], req, pos)
        finite = torch.isfinite(base.seen[row]).nonzero().flatten().tolist()
        assert finite == [token], (row, finite, token)
        assert int(out.sampled_token_ids[row]) == token
        assert float(out.logprobs_tensors.logprobs[row, 0]) == logprob  # ours, bit for bit
    assert torch.equal(base.seen[1], original[1])  # the plain request: vLLM's own logits and sampling
    assert float(out.logprobs_tensors.logprobs[1, 0]) == float(torch.log_softmax(original[1], -1).max())


def test_a_batch_without_params_is_vllms_alone():
    base = RecordingBase()
    logits = torch.randn(2, VOCAB)
    original = logits.clone()
    CanonicalSampler(base, _table({}))(logits, _batch([0, 1], [3, 4], [1, 1]))
    assert torch.equal(base.seen, original)


def test_more_rows_than_requests_is_refused():
    with pytest.raises(NotImplementedError, match="speculative"):
        CanonicalSampler(RecordingBase(), _table({}))(torch.randn(3, VOCAB), _batch([0, 1], [3, 4], [1, 1]))


class _Dims:
    def __init__(self, top_k_logprobs):
        self.top_k_logprobs = top_k_logprobs

    def max_num_logprobs(self, idx_mapping_np):
        return self.top_k_logprobs

    def max_num_token_ids(self, idx_mapping_np):
        return 0


@pytest.mark.parametrize("compute_nans, top_k_logprobs", [(False, 2), (True, 0)])
def test_batches_wanting_more_than_the_sampled_logprob_go_through_vllms_sampler(compute_nans, top_k_logprobs):
    """Where every row is ours, vLLM's output is built without its sampler (on GPU: test_vllm_plugin_gpu)
    unless the batch asks for what only vLLM's sampler computes: top-k log-probs, NaN counts."""
    base = RecordingBase()
    base.compute_nans = compute_nans
    base.sampling_states = _Dims(top_k_logprobs)
    base.logprob_token_ids_state = _Dims(0)
    cfg = dict(seed=4, temperature=0.7, top_k=0, top_p=1.0, position=5)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    out = CanonicalSampler(base, _table({0: (cfg, 5)}))(logits, _batch([0], [4], [1]))  # the first new token
    token, logprob = _expected(original[0], cfg, 5)
    assert base.seen is not None, "vLLM's sampler was skipped"
    assert torch.isfinite(base.seen[0]).nonzero().flatten().tolist() == [token]
    assert int(out.sampled_token_ids[0]) == token
    assert out.logprobs_tensors.logprobs[0].tolist() == [logprob, logprob]  # the top-k column too


def test_a_slot_taken_over_by_a_request_without_params_is_vllms():
    """vLLM reuses a finished request's slot; the new request's row must not keep the old params
    (nor may a masked row, slot -1, take the last slot's)."""
    cfg = dict(seed=4, temperature=0.7, top_k=0, top_p=1.0, position=5)
    table = _table({1: (cfg, 5), 3: (cfg, 5)})
    table.clear(1)
    base = RecordingBase()
    logits = torch.randn(2, VOCAB)
    original = logits.clone()
    # slot -1: a row vLLM masks; it must not read the table's last slot (3, which is ours)
    CanonicalSampler(base, table)(logits, _batch([1, -1], [3, 6], [1, 1]))
    assert torch.equal(base.seen, original)


def _config(device_graphs: str = "FULL_DECODE_ONLY", enforce_eager: bool = False):
    return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=device_graphs)),
                           model_config=SimpleNamespace(enforce_eager=enforce_eager, get_vocab_size=lambda: VOCAB),
                           scheduler_config=SimpleNamespace(max_num_seqs=8))


def test_sampling_is_graphed_only_where_vllm_replays_graphs_on_cuda():
    from rollout_service.vllm.sampler_graphs import SamplerGraphs
    from rollout_service.vllm.plugin.runner_v2 import sampler_graphs

    assert sampler_graphs(_config(), "cpu") is None
    assert sampler_graphs(_config("NONE"), "cuda:0") is None
    assert sampler_graphs(_config(enforce_eager=True), "cuda:0") is None
    with pytest.raises(ValueError, match="CUDA"):
        SamplerGraphs(8, VOCAB, "cpu")
    # on CUDA with graphs they are built and used: tests/gpu/test_vllm_plugin_gpu.py
    # (test_rollout_sampling_replayed_from_graphs)


class FixedGraphs:
    """Stands in for SamplerGraphs: covers every row and answers with fixed tokens and log-probs."""

    def covers(self, logits, rows):
        return True

    def __call__(self, logits, rows):
        return torch.full((len(rows),), 7), torch.full((len(rows),), -1.5)


def test_covered_rows_come_from_the_graphs_a_test_rule_never_does():
    from rollout_service.engine.sampler import RowParams
    from rollout_service.vllm.plugin.sampling import canonical_rows

    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = RowParams.from_values([1.0, 0.0], [0, 0], [1.0, 1.0], [1, 2], [5, 5])
    tokens, logprobs = canonical_rows(logits, rows, graphs=FixedGraphs())
    assert tokens.tolist() == [7, 7] and logprobs.tolist() == [-1.5, -1.5]
    eager = canonical_rows(logits, rows)
    ruled = canonical_rows(logits, rows, rule=lambda lg, r: eager[0], graphs=FixedGraphs())
    assert torch.equal(ruled[0], eager[0]) and torch.equal(ruled[1], eager[1])
    assert ruled[0].tolist() != [7, 7]


def test_params_are_checked_when_recorded_and_a_refused_request_stays_vllms():
    """Steps build their rows unchecked (RowParams.checked_already), so the table checks each request's
    values as it stores them: a temperature finite in float64 but infinite in float32 is refused, the slot
    stays vLLM's (also where it held an earlier request's params), and the next request there is ours."""
    ok = dict(seed=4, temperature=0.7, top_k=0, top_p=1.0, position=5)
    table = _table({1: (ok, 5)})
    with pytest.raises(ValueError, match="temperature"):
        table.set(1, dict(ok, temperature=1e39), 5)
    with pytest.raises(ValueError, match="top_p"):
        table.set(2, dict(ok, top_p=np.nextafter(1.0, 2.0, dtype=np.float64) * 1.5), 5)
    index, params = table.rows(np.array([1, 2]), np.array([6, 6]))
    assert len(index) == 0 and params is None  # both slots vLLM's
    base = RecordingBase()
    logits = torch.randn(2, VOCAB)
    original = logits.clone()
    CanonicalSampler(base, table)(logits, _batch([1, 2], [5, 5], [1, 1]))
    assert torch.equal(base.seen, original)
    table.set(1, ok, 5)
    index, params = table.rows(np.array([1, 2]), np.array([6, 6]))
    assert index.tolist() == [0] and params.position.tolist() == [6] and params.temperature.dtype == np.float32
