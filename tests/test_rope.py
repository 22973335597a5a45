"""kernels.rope: rotary tables from the config alone, transformers' formulas, one fixed way."""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import assert_bitwise_equal
from kernels.forward import rope_table
from kernels.rope import RopeSpec, RopeTable, to_float32
from rollout_service.engine.model_loading import load_model
from rollout_service.tiny_models import tiny_model

# Only float32 rounding separates transformers' torch math from ours: a few ulps (an ulp is 2^-23 ~ 1.2e-7).
RTOL = 1e-6


def _llama(hidden=512, heads=4, max_pos=4096, rope=None, **kw):
    return transformers.LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                                    max_position_embeddings=max_pos, rope_parameters=rope, **kw)


CONFIGS = {
    "default": lambda: _llama(),
    "default-theta1e6-qwen2": lambda: transformers.Qwen2Config(
        hidden_size=896, num_attention_heads=14, num_key_value_heads=2, rope_parameters={"rope_theta": 1e6}),
    "default-head80": lambda: _llama(hidden=640, heads=8, rope={"rope_type": "default", "rope_theta": 5e5}),
    "default-qwen3-explicit-head_dim": lambda: transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128),
    "linear": lambda: _llama(rope={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}),
    "linear-partial-rotary": lambda: _llama(rope={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.5}),
    "dynamic": lambda: _llama(max_pos=2048, rope={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    "yarn": lambda: _llama(max_pos=4096, rope={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                               "original_max_position_embeddings": 1024}),
    "yarn-mscale": lambda: _llama(max_pos=4096, rope={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 1024,
        "mscale": 1.0, "mscale_all_dim": 0.5}),
    "yarn-untruncated-betas": lambda: _llama(hidden=640, heads=8, max_pos=8192, rope={
        "rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4, "original_max_position_embeddings": 1024,
        "beta_fast": 16, "beta_slow": 2, "truncate": False}),
    "yarn-attention-factor": lambda: _llama(max_pos=4096, rope={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 1024,
        "attention_factor": 1.25}),
    "llama3.1": lambda: _llama(max_pos=131072, rope={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 5e5}),
    "llama3-small-context": lambda: _llama(hidden=256, heads=4, max_pos=512, rope={
        "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 200, "rope_theta": 1e4}),
}


def _transformers_rope(config, seq_len=None) -> tuple[torch.Tensor, float]:
    config = copy.deepcopy(config)  # transformers standardizes the config in place
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


def _ours(spec: RopeSpec, position: int = 0) -> torch.Tensor:
    return torch.tensor(spec.inv_freq(position), dtype=torch.float32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inv_freq_and_attention_scaling_match_transformers(name):
    config = CONFIGS[name]()
    spec = RopeSpec.from_config(config)
    want, scaling = _transformers_rope(config)
    assert spec.rope_type == config.rope_parameters["rope_type"]
    torch.testing.assert_close(_ours(spec), want.float(), rtol=RTOL, atol=0)
    assert spec.attention_scaling() == to_float32(scaling)


def test_yarn_attention_scaling_is_not_trivially_one():
    assert RopeSpec.from_config(CONFIGS["yarn"]()).attention_scaling() == to_float32(0.1 * math.log(4.0) + 1.0)
    mscale = (0.1 * 1.0 * math.log(4.0) + 1.0) / (0.1 * 0.5 * math.log(4.0) + 1.0)
    assert RopeSpec.from_config(CONFIGS["yarn-mscale"]()).attention_scaling() == to_float32(mscale)


def test_tolerance_catches_a_wrong_formula():
    """The parity tolerance is tight: settings one step off give frequencies far outside it."""
    config = CONFIGS["yarn-untruncated-betas"]()
    off = copy.deepcopy(config)
    off.rope_parameters["beta_slow"] = 1
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_ours(RopeSpec.from_config(off)), _transformers_rope(config)[0], rtol=RTOL, atol=0)
    config = CONFIGS["llama3.1"]()
    off = copy.deepcopy(config)
    off.rope_parameters["high_freq_factor"] = 4.5
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_ours(RopeSpec.from_config(off)), _transformers_rope(config)[0], rtol=RTOL, atol=0)


@pytest.mark.parametrize("seq_len", [1, 1000, 2048, 2049, 3000, 10000])
def test_dynamic_ntk_row_of_position_p_is_transformers_at_seq_len_p_plus_1(seq_len):
    config = CONFIGS["dynamic"]()
    spec = RopeSpec.from_config(config)
    want, _ = _transformers_rope(config, seq_len=seq_len)
    torch.testing.assert_close(_ours(spec, seq_len - 1), want, rtol=RTOL, atol=0)
    if seq_len <= config.max_position_embeddings:  # within the original length: plain RoPE, bit for bit
        default = RopeSpec.from_config(_llama(max_pos=2048))
        assert spec.inv_freq(seq_len - 1) == default.inv_freq(0)


def test_dynamic_rows_depend_only_on_their_position():
    spec = RopeSpec.from_config(_llama(hidden=64, heads=4, max_pos=64, rope={"rope_type": "dynamic", "factor": 2.0}))
    whole = RopeTable(spec)
    whole.reserve(300)
    grown = RopeTable(spec, chunk=7)  # grown piecemeal, in another order, by lookups of other batches
    for positions in ([[250, 3]], [[63, 64, 65]], [[0, 299, -1]], [list(range(300))]):
        positions = torch.tensor(positions)
        for got, want in zip(grown.lookup(positions), whole.lookup(positions)):
            assert_bitwise_equal(got, want, f"positions {positions.tolist()}")
    cos = whole.cos
    assert not torch.equal(cos[100], RopeTable(RopeSpec.from_config(_llama(hidden=64, heads=4))).lookup(
        torch.tensor([100]))[0][0])  # past max_position_embeddings the NTK rows differ from plain RoPE


# ---- config conventions -----------------------------------------------------------------------

def _v4(rope_theta=10000.0, rope_scaling=None, **kw):
    """A transformers 4.x style config: rope_theta and rope_scaling attributes, no rope_parameters."""
    settings = dict(hidden_size=512, num_attention_heads=4, max_position_embeddings=4096)
    return SimpleNamespace(**{**settings, **kw}, rope_theta=rope_theta, rope_scaling=rope_scaling)


@pytest.mark.parametrize("v4,v5", [
    (lambda: _v4(5e5), lambda: _llama(rope={"rope_type": "default", "rope_theta": 5e5})),
    (lambda: _v4(1e6, {"type": "linear", "factor": 4.0}), lambda: CONFIGS["linear"]()),
    (lambda: _v4(1e4, {"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=2048),
     lambda: CONFIGS["dynamic"]()),
    (lambda: _v4(1e6, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
     lambda: CONFIGS["yarn"]()),
    (lambda: _v4(1e6, {"rope_type": "yarn", "factor": 4.0}, original_max_position_embeddings=1024),
     lambda: CONFIGS["yarn"]()),
    (lambda: _v4(5e5, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}, max_position_embeddings=131072),
     lambda: CONFIGS["llama3.1"]()),
    (lambda: _v4(1e4, {"type": "linear", "factor": 2.0}, partial_rotary_factor=0.5),
     lambda: CONFIGS["linear-partial-rotary"]()),
], ids=["default", "linear-legacy-type-key", "dynamic", "yarn", "yarn-original-max-on-config", "llama3",
        "linear-partial-rotary"])
def test_transformers_4_and_5_conventions_give_the_same_table(v4, v5):
    old, new = RopeSpec.from_config(v4()), RopeSpec.from_config(v5())
    assert old.rope_type == new.rope_type and old.rotary_dim == new.rotary_dim
    for position in (0, 5000):
        assert old.inv_freq(position) == new.inv_freq(position)
    assert old.attention_scaling() == new.attention_scaling()


@pytest.mark.parametrize("rope_type", ["longrope", "su", "proportional", "mrope"])
def test_unsupported_rope_type_raises_naming_it(rope_type):
    with pytest.raises(ValueError, match=f"unsupported rope_type '{rope_type}'"):
        RopeSpec.from_config(_v4(rope_scaling={"type": rope_type, "factor": 2.0}))
    config = _llama()
    config.rope_parameters = {"rope_type": rope_type, "rope_theta": 1e4}
    with pytest.raises(ValueError, match=rope_type):
        RopeTable.from_config(config)


def test_missing_rope_parameters_raise():
    with pytest.raises(ValueError, match="factor"):
        RopeSpec.from_config(_v4(rope_scaling={"type": "linear"}))
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeSpec.from_config(_v4(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}))


# ---- the table ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["default", "yarn-mscale", "llama3.1"])
def test_table_rows_are_the_fixed_formula_and_close_to_transformers_rotary(name):
    config = CONFIGS[name]()
    table = RopeTable.from_config(config)
    positions = torch.tensor([[0, 1, 17, 255, 4095, -1]])
    cos, sin = table.lookup(positions)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (1, 6, table.spec.rotary_dim // 2)
    inv_freq, scaling = table.spec.inv_freq(0), torch.tensor(table.spec.attention_scaling())
    for j, p in enumerate(positions[0].clamp_min(0).tolist()):
        want_cos = torch.tensor([math.cos(p * f) for f in inv_freq], dtype=torch.float64).float() * scaling
        want_sin = torch.tensor([math.sin(p * f) for f in inv_freq], dtype=torch.float64).float() * scaling
        assert_bitwise_equal(cos[0, j], want_cos, f"cos at {p}")
        assert_bitwise_equal(sin[0, j], want_sin, f"sin at {p}")
    # transformers' own rotary module (float32 torch math) agrees to float32 angle rounding
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(copy.deepcopy(config))
    hf_pos = torch.tensor([[0, 1, 17, 255]])
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), hf_pos)
    half = table.spec.rotary_dim // 2
    our_cos, our_sin = table.lookup(hf_pos)
    torch.testing.assert_close(our_cos, hf_cos[..., :half], rtol=0, atol=1e-4)
    torch.testing.assert_close(our_sin, hf_sin[..., :half], rtol=0, atol=1e-4)


def test_reserve_and_lookup_keep_their_semantics():
    table = RopeTable.from_config(_llama(hidden=64, heads=4), chunk=16)
    table.reserve(20, "cpu")
    assert table.cos.shape == (32, 8)  # grown to whole chunks
    table.lookup(torch.tensor([[40]]))
    assert table.cos.shape == (48, 8)
    cos, sin = table.lookup(torch.tensor([[-1, 0]]))  # padding reads row 0
    assert torch.equal(cos[0, 0], cos[0, 1]) and torch.equal(cos[0, 1], torch.ones(8))


def test_a_bounded_table_never_grows_on_lookup():
    """bound(n): positions stay below n (vLLM's max_model_len), so lookups skip the growth check (a
    host sync); the rows are those of a table grown on demand, and a position past them is an error."""
    config = _llama(hidden=64, heads=4)
    bounded, grown = RopeTable.from_config(config, chunk=16), RopeTable.from_config(config, chunk=16)
    bounded.bound(20, "cpu")
    positions = torch.tensor([[0, 7, 19, -1]])
    for got, want in zip(bounded.lookup(positions), grown.lookup(positions)):
        assert_bitwise_equal(got, want, "bounded vs grown")
    with pytest.raises(IndexError):
        bounded.lookup(torch.tensor([[40]]))  # 32 rows (whole chunks): no growth
    assert bounded.cos.shape == (32, 8)


def _save(tmp_path, arch="llama", rope=None):
    model = tiny_model(arch, seed=5, dtype=torch.float32)
    if rope is not None:
        model.config.rope_parameters = rope
    model.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("arch,rope", [
    ("llama", None),
    ("qwen3", None),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1e6}),
])
def test_table_does_not_depend_on_how_the_model_object_was_made(tmp_path, arch, rope):
    path = _save(tmp_path, arch, rope)
    auto = transformers.AutoModelForCausalLM
    models = {
        "from_pretrained-bf16": auto.from_pretrained(path, dtype=torch.bfloat16),
        "from_pretrained-fp32-to-bf16": auto.from_pretrained(path, dtype=torch.float32).to(torch.bfloat16),
        "from_pretrained-fp32": auto.from_pretrained(path, dtype=torch.float32),
        "engine": load_model(str(path), torch.device("cpu")),
    }
    # the buffers do differ (that was the bug); the tables must not
    assert models["from_pretrained-bf16"].model.rotary_emb.inv_freq.dtype == torch.float32
    assert models["engine"].model.rotary_emb.inv_freq.dtype == torch.bfloat16
    positions = torch.arange(300)[None]
    want = RopeTable.from_config(transformers.AutoConfig.from_pretrained(path)).lookup(positions)
    for name, model in models.items():
        for got, expect in zip(rope_table(model).lookup(positions), want):
            assert_bitwise_equal(got, expect, name)


def test_table_ignores_the_rotary_buffer(tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(_save(tmp_path), dtype=torch.bfloat16)
    want = RopeTable.from_config(model.config).lookup(torch.arange(10)[None])
    model.model.rotary_emb.inv_freq.mul_(2)
    for got, expect in zip(rope_table(model).lookup(torch.arange(10)[None]), want):
        assert_bitwise_equal(got, expect)


def test_partial_rotary_is_refused_by_the_forward():
    model = tiny_model("llama", dtype=torch.float32)
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                    "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial rotary"):
        rope_table(model)
