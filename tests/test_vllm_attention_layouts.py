"""The vLLM plugin's two query layouts (rollout_service.vllm.plugin.attention): a step that a full CUDA
graph may replay keeps every token its own [N, 1] row, prefill chunks included; an eager step with
prefill chunks attends them packed. The metadata builder picks by the step's token count and the
engine's graph mode, and both layouts give every row the same bits, equal to a whole-sequence
(training) forward's attention.
"""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import kernels as K  # noqa: E402
from kernels.opset import CANONICAL_OPS  # noqa: E402
from rollout_service.vllm.plugin import CUDA_GRAPH_COMPILATION, GRAPH_CAPTURE_SIZES, graph_options, llm_options  # noqa: E402
from rollout_service.vllm.plugin.attention import (PagedKVAdapter, ZeroKLMetadataBuilder,  # noqa: E402
                                                    graphed_step_tokens)
from vllm.config.compilation import CUDAGraphMode  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 4, 2, 16, 4, 16
# one step: request 0 a 5-token prompt chunk from position 0; request 1 one decode token at position 7
# (7 keys cached); request 2 a 3-token chunk from position 4 (4 keys cached); then 2 padding tokens
REQUESTS = [(0, 5), (7, 1), (4, 3)]  # (first position, tokens this step)
PADDING = 2


def _graph_config(mode: str, largest: int):
    return SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode], max_cudagraph_capture_size=largest)


def test_graphed_step_tokens_follow_the_graph_mode():
    assert graphed_step_tokens(_graph_config("FULL", 4096)) == 4096
    assert graphed_step_tokens(_graph_config("FULL_DECODE_ONLY", 512)) == 0
    assert graphed_step_tokens(_graph_config("NONE", 512)) == 0
    assert graphed_step_tokens(SimpleNamespace(cudagraph_mode=None, max_cudagraph_capture_size=None)) == 0


def test_prefill_graphs_on_v2_at_one_rank_only():
    v2 = llm_options(None, runner="v2")["compilation_config"]
    assert v2["cudagraph_mode"] == "FULL" and v2["cudagraph_capture_sizes"] == list(GRAPH_CAPTURE_SIZES)
    assert max(GRAPH_CAPTURE_SIZES) == 4096 and list(GRAPH_CAPTURE_SIZES) == sorted(set(GRAPH_CAPTURE_SIZES))
    assert llm_options(None, runner="v1")["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert graph_options(True, "v2", 2)["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert graph_options(False, "v2") == {"enforce_eager": True}
    graph_options(True, "v2")["compilation_config"]["cudagraph_capture_sizes"].append(1)  # a copy
    assert CUDA_GRAPH_COMPILATION["all_steps"]["cudagraph_capture_sizes"] == list(GRAPH_CAPTURE_SIZES)
    with pytest.raises(ValueError, match="runner"):
        graph_options(True, "v3")


def _step(seed: int = 0):
    """The step's metadata inputs, its q/k/v rows and a paged cache holding the earlier keys."""
    g = torch.Generator().manual_seed(seed)
    starts = [0]
    for _, n in REQUESTS:
        starts.append(starts[-1] + n)
    tokens = starts[-1] + PADDING
    table = torch.arange(len(REQUESTS) * 4, dtype=torch.int32).reshape(len(REQUESTS), 4) + 1  # block 0: vLLM's null
    positions, slots = [], []
    for r, (first, n) in enumerate(REQUESTS):
        for p in range(first, first + n):
            positions.append(p)
            slots.append(int(table[r, p // BLOCK]) * BLOCK + p % BLOCK)
    positions += [0] * PADDING
    slots += [-1] * PADDING
    cache = torch.randn(BLOCKS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)  # vLLM 0.25's layout
    q, k, v = (torch.randn(tokens, 1, h, HEAD_DIM, generator=g).to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    m = SimpleNamespace(num_reqs=len(REQUESTS), num_actual_tokens=tokens,
                        max_query_len=max(n for _, n in REQUESTS),
                        query_start_loc=torch.tensor(starts, dtype=torch.int32),
                        query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
                        block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64))
    return m, cache, (q, k, v), torch.tensor(positions).reshape(tokens, 1), starts


def _attend(graphed_tokens: int, seed: int = 0):
    """(metadata, output rows, cache after the step) with a builder that graphs steps up to graphed_tokens."""
    m, cache, (q, k, v), positions, starts = _step(seed)
    builder = object.__new__(ZeroKLMetadataBuilder)  # the base class wants a whole engine config
    builder.device, builder.graphed_tokens = torch.device("cpu"), graphed_tokens
    metadata = builder.build(0, m)
    kv = PagedKVAdapter([cache], metadata, HEAD_DIM, m.num_actual_tokens)
    out = kv.attend(CANONICAL_OPS, 0, q, k, v, positions, HEAD_DIM ** -0.5)
    return metadata, out[: starts[-1]], cache


def test_graphed_steps_keep_one_row_per_token_and_match_the_packed_layout():
    tokens = sum(n for _, n in REQUESTS) + PADDING
    packed_md, packed, packed_cache = _attend(graphed_tokens=tokens - 1)  # one token over: eager, packed
    rows_md, rows, rows_cache = _attend(graphed_tokens=tokens)
    assert packed_md.prefill is not None and rows_md.prefill is None
    assert torch.equal(packed, rows) and torch.equal(packed_cache, rows_cache)
    assert packed.abs().sum() > 0
    decode_md, _, _ = _attend(graphed_tokens=0)  # graphs off: packed as well
    assert decode_md.prefill is not None


def test_both_layouts_equal_a_whole_sequence_forward():
    """Each request's rows equal the training forward's attention over its whole sequence, whose
    earlier keys are the ones cached."""
    m, cache, _, _, starts = _step()
    for graphed_tokens in (0, m.num_actual_tokens):
        _, out, written = _attend(graphed_tokens)
        kp, vp = written.unbind(1)
        for r, (first, n) in enumerate(REQUESTS):
            blocks = m.block_table_tensor[r].long()
            keys = kp[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[: first + n]
            values = vp[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[: first + n]
            _, _, (q, _, _), _, _ = _step()
            rows = torch.zeros(first + n, HEADS, HEAD_DIM, dtype=torch.bfloat16)
            rows[first:] = q[starts[r]: starts[r + 1], 0]
            full = K.attention(rows[None], keys[None], values[None], torch.arange(first + n)[None],
                               scale=HEAD_DIM ** -0.5)[0]
            assert torch.equal(out[starts[r]: starts[r + 1], 0], full[first:]), (graphed_tokens, r)


def test_a_different_query_changes_the_rows():
    """Negative control: the comparison above sees a change of inputs."""
    _, a, _ = _attend(graphed_tokens=0, seed=0)
    _, b, _ = _attend(graphed_tokens=0, seed=1)
    assert not torch.equal(a, b)
