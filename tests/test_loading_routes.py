"""A trainer scores the engine's rollouts bit for bit, whichever way it loads the checkpoint.

Each checkpoint is written with save_pretrained (float32 masters, as trainers save them, and bf16) and
served by `Engine(path)`. The trainer side loads the same directory the ways users do: from_pretrained
in bf16, float32 then .to(bf16), from_config + load_state_dict, float32 masters under FSDP2 mixed
precision (patched before or after fully_shard) and a plain float32 model. Negative controls show that
the variation matters: the rotary buffer the old table was read from differs between routes, and the
unpatched forward does not give the rollout's log-probs. For Qwen3-MoE every route's forward also
routes each generated token as the rollout recorded it (return_routed_experts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from conftest import assert_bitwise_equal

import trainer_patch
from rollout_service import Engine, SamplingParams
from rollout_service.params import Rollout
from rollout_service.tiny_models import tiny_model

TEMPERATURE = 0.7
MAX_TOKENS = 48
PROMPT_LENGTHS = (12, 19, 27, 35, 8, 22)  # with MAX_TOKENS, positions run past 64 (llama3 / yarn / dynamic)
GREEDY_PROMPTS = 2

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


@dataclass(frozen=True)
class CheckpointSpec:
    arch: str
    rope: dict | None = None
    max_positions: int = 512
    saved_dtype: torch.dtype = torch.float32


CHECKPOINTS = {
    "llama": CheckpointSpec("llama"),
    "llama-llama3": CheckpointSpec("llama", LLAMA3),
    "qwen2": CheckpointSpec("qwen2"),
    "qwen3": CheckpointSpec("qwen3"),
    "qwen3_moe": CheckpointSpec("qwen3_moe"),  # every layer sparse: routing runs in every forward
    "qwen2-yarn": CheckpointSpec("qwen2", YARN, max_positions=256),
    "llama-linear": CheckpointSpec("llama", LINEAR),
    # max_position_embeddings 64: later positions take the per-position dynamic-NTK rows
    "qwen3-dynamic": CheckpointSpec("qwen3", DYNAMIC, max_positions=64),
    "qwen2-saved-bf16": CheckpointSpec("qwen2", saved_dtype=torch.bfloat16),
    "llama-llama3-saved-bf16": CheckpointSpec("llama", LLAMA3, saved_dtype=torch.bfloat16),
}


@dataclass
class Served:
    path: Path
    sampled: list[Rollout]  # temperature TEMPERATURE, seeded
    greedy: list[Rollout]  # temperature 0: log-probs at temperature 1
    engine_model: torch.nn.Module


def _prompts(seed: int = 0, vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _save_checkpoint(name: str, path: Path) -> None:
    spec = CHECKPOINTS[name]
    model = tiny_model(spec.arch, seed=sum(map(ord, name)), dtype=spec.saved_dtype, max_positions=spec.max_positions)
    if spec.rope is not None:
        model.config.rope_parameters = dict(spec.rope)  # only the saved config.json matters
    model.save_pretrained(path)


def _serve(name: str, path: Path) -> Served:
    _save_checkpoint(name, path)
    max_positions = CHECKPOINTS[name].max_positions
    engine = Engine(str(path), fast_path="native", device="cpu",
                    max_model_len=max(max_positions, max(PROMPT_LENGTHS) + MAX_TOKENS + 1))
    prompts = _prompts()
    sampled = engine.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=100 + i,
                                                       determinism="verified", return_routed_experts=True)
                                        for i in range(len(prompts))])
    greedy = engine.generate(prompts[:GREEDY_PROMPTS], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                      determinism="verified",
                                                                      return_routed_experts=True))
    for r in sampled + greedy:
        assert r.ok and len(r.token_ids) == len(r.logprobs) == MAX_TOKENS, r.error
        assert (r.routed_experts is None) == (CHECKPOINTS[name].arch != "qwen3_moe")  # dense: None
    return Served(path, sampled, greedy, engine.model)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cache: dict[str, Served] = {}

    def get(name: str) -> Served:
        if name not in cache:
            cache[name] = _serve(name, tmp_path_factory.mktemp(name))
        return cache[name]
    return get


# ---- the trainer's loading routes --------------------------------------------------------------

def _bf16_from_pretrained(path, mesh=None):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def _fp32_then_bf16(path, mesh=None):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(torch.bfloat16)


def _from_config_and_state_dict(path, mesh=None):
    from safetensors.torch import load_file
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    model.load_state_dict(load_file(path / "model.safetensors"))
    return model


def _fsdp2(path, mesh, *, patch_first: bool, cast_forward_inputs: bool = False):
    """float32 masters sharded with fully_shard (each decoder layer, then the root), bf16 compute."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if patch_first:
        trainer_patch.patch_model(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              cast_forward_inputs=cast_forward_inputs)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if not patch_first:
        trainer_patch.patch_model(model)
    return model


def _fp32_plain(path, mesh=None):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


ROUTES = {
    "from_pretrained-bf16": _bf16_from_pretrained,
    "from_pretrained-fp32-to-bf16": _fp32_then_bf16,
    "from_config-load_state_dict": _from_config_and_state_dict,
    "fsdp2-patch-before-shard": lambda path, mesh: _fsdp2(path, mesh, patch_first=True),
    "fsdp2-patch-after-shard": lambda path, mesh: _fsdp2(path, mesh, patch_first=False),
    "fp32-plain": _fp32_plain,
}


def _padded(rollouts: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [r.prompt_token_ids + r.token_ids for r in rollouts]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return ids, mask


def _completion_logprobs(logp: torch.Tensor, rollouts: list[Rollout]) -> list[torch.Tensor]:
    """Row i's log-probs of the generated tokens out of [B, T-1] next-token log-probs."""
    return [logp[i, len(r.prompt_token_ids) - 1:len(r.prompt_token_ids) - 1 + len(r.token_ids)]
            for i, r in enumerate(rollouts)]


def _score(model, rollouts: list[Rollout], temperature: float, routing: list | None = None) -> list[torch.Tensor]:
    ids, mask = _padded(rollouts)
    logp = trainer_patch.token_logprobs(model, ids, mask, temperature=temperature, routing=routing)
    return _completion_logprobs(logp, rollouts)


def _assert_routing_equals_rollouts(routing: list[torch.Tensor], rollouts: list[Rollout], what: str) -> None:
    """The forward's per-layer expert ids [B, T, k] at each generated token's row = the recorded ones."""
    assert routing, f"{what}: the forward recorded no routing"
    rows = torch.stack(routing, dim=2)  # [B, T, layers, k]
    for i, r in enumerate(rollouts):
        p = len(r.prompt_token_ids)
        assert rows[i, p - 1:p - 1 + len(r.token_ids)].tolist() == r.routed_experts, f"{what}: rollout {i} routing"


def _rollout_logprobs(r: Rollout) -> torch.Tensor:
    return torch.tensor(r.logprobs, dtype=torch.float32)


def _assert_scores_equal_rollouts(model, srv: Served, what: str) -> torch.Tensor:
    """Bitwise comparison of sampled and greedy rollouts; returns the summed (differentiable) log-probs."""
    total = torch.zeros(())
    for rollouts, temperature in ((srv.sampled, TEMPERATURE), (srv.greedy, 1.0)):
        routing = [] if rollouts[0].routed_experts is not None else None
        for i, (got, r) in enumerate(zip(_score(model, rollouts, temperature, routing), rollouts)):
            assert_bitwise_equal(got.detach(), _rollout_logprobs(r), f"{what}: T={temperature} rollout {i}")
            total = total + got.sum()
        if routing is not None:
            _assert_routing_equals_rollouts(routing, rollouts, f"{what}: T={temperature}")
    return total


# transformers saves a Qwen3-MoE checkpoint with one tensor per expert and fuses them when it loads;
# a raw load_state_dict of the file into from_config's fused model is not a way to load it at all.
ROUTE_PAIRS = [(c, r) for c in CHECKPOINTS for r in ROUTES
               if not (CHECKPOINTS[c].arch == "qwen3_moe" and r == "from_config-load_state_dict")]


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
@pytest.mark.parametrize("checkpoint, route", ROUTE_PAIRS)
def test_trainer_route_scores_rollouts_bitwise(served, gloo_group, checkpoint, route):
    srv = served(checkpoint)
    model = ROUTES[route](srv.path, gloo_group)
    with torch.no_grad():
        _assert_scores_equal_rollouts(model, srv, f"{checkpoint} / {route}")


@pytest.mark.parametrize("checkpoint", ["llama-llama3", "qwen3", "qwen2-saved-bf16"])
def test_plain_fp32_model_computes_the_canonical_bf16_forward_with_fp32_gradients(served, checkpoint):
    """A float32 model given to patch_model: canonical bf16 numbers, gradients on the float32 parameters."""
    srv = served(checkpoint)
    model = trainer_patch.patch_model(_fp32_plain(srv.path)).train()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    total = _assert_scores_equal_rollouts(model, srv, f"{checkpoint} / fp32-plain")
    total.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_fsdp2_masters_receive_finite_float32_gradients(served, gloo_group):
    srv = served("qwen2")
    model = _fsdp2(srv.path, gloo_group, patch_first=True).train()
    _assert_scores_equal_rollouts(model, srv, "qwen2 / fsdp2").backward()
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
@pytest.mark.parametrize("checkpoint", ["llama", "qwen3_moe"])
def test_fsdp2_default_mixed_precision_policy_scores_rollouts_bitwise(served, gloo_group, checkpoint):
    """The default policy casts floating tensors in each layer's arguments to bf16; the float32
    rotary rows must not be among them (kernels.forward.ForwardContext is not a dataclass). It also
    rebuilds the lists among the root's arguments: the routing still reaches token_logprobs' list
    (trainer_patch.patch.RoutingSink), as in the recipe's trainer."""
    srv = served(checkpoint)
    model = _fsdp2(srv.path, gloo_group, patch_first=True, cast_forward_inputs=True)
    with torch.no_grad():
        _assert_scores_equal_rollouts(model, srv, f"{checkpoint} / fsdp2 default policy")


# ---- negative controls: the variation the routes cover is real ----------------------------------

class BufferRopeTable:
    """The table the forward used to build: cos/sin from the module's inv_freq buffer as it is."""

    def __init__(self, model):
        rotary = model.model.rotary_emb
        self.inv_freq = [float(f) for f in rotary.inv_freq.detach().float()]
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = [[p * f for f in self.inv_freq] for p in range(int(positions.max()) + 1)]
        cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64).float()
        sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64).float()
        idx = positions.clamp_min(0)
        return (cos * self.scaling)[idx], (sin * self.scaling)[idx]


@pytest.mark.parametrize("checkpoint", ["llama", "llama-llama3", "qwen2-yarn"])
def test_negative_control_buffer_tables_differ_between_routes(served, checkpoint):
    srv = served(checkpoint)
    trainer = _bf16_from_pretrained(srv.path)
    # from_pretrained(dtype=bf16) keeps the buffer in float32; the engine's .to(bf16) rounds it
    assert trainer.model.rotary_emb.inv_freq.dtype == torch.float32
    assert srv.engine_model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    positions = torch.arange(max(PROMPT_LENGTHS) + MAX_TOKENS)[None]
    trainer_cos, _ = BufferRopeTable(trainer).lookup(positions)
    engine_cos, _ = BufferRopeTable(srv.engine_model).lookup(positions)
    assert not torch.equal(trainer_cos, engine_cos)
    # the old behaviour end to end: the trainer's scores depend on whose buffer the table came from
    trainer_patch.patch_model(trainer)
    ids, mask = _padded(srv.sampled)
    scores = []
    with torch.no_grad():
        for source in (trainer, srv.engine_model):
            trainer.__dict__["_zerokl_rope"] = BufferRopeTable(source)
            scores.append(trainer_patch.token_logprobs(trainer, ids, mask, temperature=TEMPERATURE))
    assert not torch.equal(scores[0], scores[1])
    del trainer.__dict__["_zerokl_rope"]  # the config's table: both buffers give way to it
    from kernels.forward import rope_table
    assert torch.equal(rope_table(trainer).lookup(positions)[0], rope_table(srv.engine_model).lookup(positions)[0])


@pytest.mark.parametrize("checkpoint", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("route", ["from_pretrained-bf16", "fp32-plain"])
def test_negative_control_unpatched_forward_is_not_the_rollouts(served, checkpoint, route):
    srv = served(checkpoint)
    model = ROUTES[route](srv.path).eval()
    ids, mask = _padded(srv.sampled)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()[:, :-1] / TEMPERATURE
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    got = torch.cat(_completion_logprobs(logp, srv.sampled))
    want = torch.cat([_rollout_logprobs(r) for r in srv.sampled])
    assert not torch.equal(got, want)
    assert (got - want).abs().max() < 0.5  # the same model, only other numerics
