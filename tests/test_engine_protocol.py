"""The engine contract (rollout_service/engine/protocol.py): every engine class a worker drives has the
RolloutEngine methods, those that say they take bucketed pushes have the BucketedPushEngine ones, and
what capabilities() says is what the engine does. (VLLMEngine's behaviour: tests/test_vllm_engine.py.)
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from rollout_service import InvalidRequestError, SamplingParams
from rollout_service.engine.engine import Engine
from rollout_service.engine.protocol import BucketedPushEngine, EngineCapabilities, LoraEngine, RolloutEngine
from rollout_service.engine.tp import TPEngine, free_port, init_tp_group
from rollout_service.engine.tp.engine import ENGINE_METHODS
from rollout_service.engine.tp.ray_group import _EngineProxy
from rollout_service.tiny_models import tiny_model
from rollout_service.weight_digest import model_digest

OPTIONS = dict(window=4, group=4, kv_cache_tokens=2048)
PROMPTS = [[5, 9, 2, 7], [3, 3, 8]]


def _members(protocol) -> set[str]:
    """The names a protocol declares: its methods and annotated attributes, inherited ones included."""
    names = set()
    for cls in protocol.__mro__:
        if cls in (object,) or not getattr(cls, "_is_protocol", False) or cls.__name__ == "Protocol":
            continue
        names |= {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
        names |= set(getattr(cls, "__annotations__", {}))
    return names


def _lacks(cls, protocol) -> set[str]:
    """The protocol's names a class does not define (attributes set in __init__ are not seen here)."""
    return {n for n in _members(protocol) if not hasattr(cls, n)} - set(getattr(protocol, "__annotations__", {}))


def test_every_engine_class_has_the_contracts_methods():
    assert _members(RolloutEngine) >= {"capabilities", "add_request", "abort", "step", "has_unfinished",
                                       "update_weights", "weights_digest", "canonical_config", "sleep", "wake"}
    assert _members(BucketedPushEngine) - _members(RolloutEngine) == {
        "device", "weight_spec", "load_named_weights", "wait_host_copies", "finish_weight_load"}
    for cls in (Engine, TPEngine):
        assert not _lacks(cls, RolloutEngine), (cls.__name__, _lacks(cls, RolloutEngine))
    assert not _lacks(Engine, BucketedPushEngine)
    # a TP group's proxy forwards each call of the contract to rank 0 (or answers it itself)
    assert _members(RolloutEngine) <= set(ENGINE_METHODS) | {"capabilities"}


def test_the_vllm_engine_class_has_the_contracts_methods():
    pytest.importorskip("vllm")
    from rollout_service.vllm.engine import VLLMEngine
    assert not _lacks(VLLMEngine, BucketedPushEngine)


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny:qwen3_moe", **OPTIONS)


def test_native_engine_capabilities(engine):
    assert isinstance(engine, RolloutEngine) and isinstance(engine, BucketedPushEngine)
    assert isinstance(engine, LoraEngine)
    assert engine.capabilities() == EngineCapabilities(switch_modes=True, routing_records=True,
                                                       bucketed_push=True, sleep=False, lora_adapters=True)


def test_native_engine_records_routing(engine):
    rollouts = engine.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, return_routed_experts=True))
    assert all(r.ok and r.routed_experts is not None and len(r.routed_experts) == 4 for r in rollouts)


def test_native_engine_switches_weights_in_flight(engine):
    """switch_modes: weights pushed between two steps with a request running; its later tokens carry
    the new version."""
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))
    done = dict(engine.step())
    before = engine.weight_version
    engine.update_weights(engine.model.state_dict())
    while rid not in done:
        done.update(engine.step())
    versions = done[rid].weight_versions
    assert done[rid].ok and versions[0] == before and versions[-1] == before + 1


def test_native_engine_takes_a_bucketed_push(engine):
    other = tiny_model("qwen3_moe", seed=5).to(torch.bfloat16)
    assert set(engine.weight_spec()) == set(other.state_dict())
    named = list(other.state_dict().items())
    engine.load_named_weights(named[:3])
    engine.load_named_weights(named[3:])
    engine.wait_host_copies()
    engine.finish_weight_load()
    assert engine.weights_digest() == model_digest(other)


def test_native_engine_sleep_releases_nothing_and_serves_on(engine):
    assert not engine.capabilities().sleep
    engine.sleep()
    engine.wake_weights()
    engine.wake()
    assert all(r.ok for r in engine.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0)))


def test_stock_only_serves_off_alone():
    stock = Engine("tiny:qwen2", stock_only=True, sleep_mode=True, **OPTIONS)
    assert stock.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0, determinism="off"))[0].ok
    with pytest.raises(InvalidRequestError, match="stock_only"):
        stock.add_request(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0))


def test_tp_engine_capabilities_are_what_it_does():
    """Rank 0 of a one-rank group: no routing records (refused at the forward), no bucketed pushes
    through its proxy, weights switched with nothing running only."""
    ctx = init_tp_group(0, 1, free_port())
    try:
        tp = TPEngine("tiny:qwen3_moe", ctx, **OPTIONS)
        caps = tp.capabilities()
        assert isinstance(tp, RolloutEngine)
        assert caps == EngineCapabilities(switch_modes=False, routing_records=False, bucketed_push=False, sleep=False)
        proxy = _EngineProxy(SimpleNamespace(update_weights=tp.update_weights))  # a TPGroup's stand-in
        assert isinstance(proxy, RolloutEngine) and not isinstance(proxy, BucketedPushEngine)
        assert proxy.capabilities() == caps
        with pytest.raises(NotImplementedError, match="routing"):
            tp.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0.0, return_routed_experts=True))
        tp.close()
    finally:
        dist.destroy_process_group()
