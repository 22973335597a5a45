"""A decoder layer frees each intermediate once it is used. In vLLM the peak of the profiling prefill
step is left out of the KV cache, so every intermediate still alive during the MLP is cache capacity
lost to the plugin."""
import dataclasses
import weakref

import pytest
import torch
import transformers

import kernels.forward as forward_module
from kernels.forward import CANONICAL_OPS, forward_hidden, fuse_projections
from rollout_service.tiny_models import tiny_model


def _storage_ref(t: torch.Tensor) -> weakref.ref:
    """Alive while any view of t is (split projections are views of one matmul output)."""
    return weakref.ref(t.untyped_storage())


def _alive_at_down_proj(model, ids) -> list[list[str]]:
    """Per layer: which earlier outputs of the layer (q/k/v and gate/up projections, their SiLU
    product's inputs, the attention output) are still referenced when down_proj's matmul starts."""
    outputs: list[tuple[str, weakref.ref]] = []
    report: list[list[str]] = []

    def linear(x, w, b=None, row_parallel=False):
        out = CANONICAL_OPS.linear(x, w, b, row_parallel=row_parallel)
        if row_parallel and w.shape[0] == model.config.hidden_size and w.shape[1] == model.config.intermediate_size:
            report.append([name for name, ref in outputs if ref() is not None])
            outputs.clear()
            return out
        outputs.append((("o_proj" if row_parallel else f"projection {w.shape[0]}"), _storage_ref(out)))
        return out

    def attention(*args, **kwargs):
        out = CANONICAL_OPS.attention(*args, **kwargs)
        outputs.append(("attention", _storage_ref(out)))
        return out

    ops = dataclasses.replace(CANONICAL_OPS, linear=linear, attention=attention)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        forward_hidden(model, ids, positions, ops=ops)
    return report


@pytest.mark.parametrize("fused", [False, True])  # the trainer's model; the vLLM plugin's (fused projections)
def test_layer_frees_intermediates_before_down_proj(tmp_path, fused):
    tiny_model("llama", seed=1, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    if fused:
        fuse_projections(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    report = _alive_at_down_proj(model, ids)
    assert len(report) == model.config.num_hidden_layers
    assert report == [[]] * len(report), report  # e.g. ['projection 128', ...] if gate/up outlive their use


@pytest.mark.parametrize("fused", [False, True])
def test_long_steps_run_the_mlp_in_row_chunks_with_the_same_bits(tmp_path, monkeypatch, fused):
    """Past MLP_CHUNK_BYTES of gate/up output (a long prefill step) the MLP runs in row chunks: no gate/up
    output is larger than one chunk, and the hidden states are bitwise those of the whole-step MLP."""
    tiny_model("qwen2", seed=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    if fused:
        fuse_projections(model)
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    inter = model.config.intermediate_size
    gate_up_rows: list[int] = []

    def linear(x, w, b=None, row_parallel=False):
        if not row_parallel and w.shape[0] in (inter, 2 * inter):
            gate_up_rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return CANONICAL_OPS.linear(x, w, b, row_parallel=row_parallel)

    ops = dataclasses.replace(CANONICAL_OPS, linear=linear)
    with torch.no_grad():
        whole = forward_hidden(model, ids, positions, ops=ops)
        assert set(gate_up_rows) == {21}
        gate_up_rows.clear()
        monkeypatch.setattr(forward_module, "MLP_CHUNK_ROWS", None)  # the byte budget: 8 rows of gate/up
        monkeypatch.setattr(forward_module, "MLP_CHUNK_BYTES", 8 * 4 * inter + 1)
        chunked = forward_hidden(model, ids, positions, ops=ops)
    per_layer = [8, 8, 5] if fused else [8, 8, 8, 8, 5, 5]  # unfused: gate and up each see every chunk
    assert sorted(gate_up_rows, reverse=True) == sorted(per_layer * model.config.num_hidden_layers, reverse=True)
    assert torch.equal(chunked, whole)


@pytest.mark.parametrize("value, expected", [(None, None), ("16384", 16384), ("0", ValueError), ("4k", ValueError)])
def test_the_mlp_chunk_rows_come_from_the_environment(monkeypatch, value, expected):
    """ZEROKL_MLP_CHUNK_ROWS sets the chunk size (vLLM's engine process reads it at import); unset, the byte
    budget decides; a value that is not a positive count is refused with the variable's name."""
    if value is None:
        monkeypatch.delenv(forward_module.MLP_CHUNK_ROWS_ENV, raising=False)
    else:
        monkeypatch.setenv(forward_module.MLP_CHUNK_ROWS_ENV, value)
    if expected is ValueError:
        with pytest.raises(ValueError, match="ZEROKL_MLP_CHUNK_ROWS"):
            forward_module._mlp_chunk_rows()
    else:
        assert forward_module._mlp_chunk_rows() == expected


def test_by_default_the_chunk_rows_keep_gate_up_within_the_byte_budget(monkeypatch):
    """Unset, a chunk is the most rows whose gate/up output fits MLP_CHUNK_BYTES: vLLM's 16,384-token prefill
    steps run whole at Qwen2.5-1.5B and Llama-3.1-8B widths, as stock vLLM's MLP does; wider MLPs chunk."""
    monkeypatch.setattr(forward_module, "MLP_CHUNK_ROWS", None)
    for intermediate in (8960, 9728, 14336, 27648):
        rows = forward_module.mlp_chunk_rows(intermediate)
        assert rows * 4 * intermediate <= forward_module.MLP_CHUNK_BYTES < (rows + 1) * 4 * intermediate
    assert forward_module.mlp_chunk_rows(8960) == 29959 and forward_module.mlp_chunk_rows(14336) == 18724
    assert forward_module.mlp_chunk_rows(27648) < 16384
    monkeypatch.setattr(forward_module, "MLP_CHUNK_ROWS", 512)
    assert forward_module.mlp_chunk_rows(8960) == 512
