"""One local Ray cluster and one 2-worker pool shared by the service test modules.

Starting Ray and worker actors (each imports torch and loads a model) costs far more than the tests
themselves, so both modules use the same ones; the last module that needs them shuts them down.
"""
from __future__ import annotations

import pytest

from conftest import rollout_bits

ENGINE_KWARGS = dict(window=4, group=8)  # short windows: verified requests roll back within max_tokens
POOL_NAME = "rollout"

_state: dict = {}




def assert_same(got, want, what=""):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.ok and w.ok, f"{what} request {i}: {g.error or w.error}"
        assert rollout_bits(g) == rollout_bits(w), f"{what} request {i}: {g.token_ids} != {w.token_ids}"


def model():
    if "model" not in _state:
        from rollout_service.tiny_models import tiny_model
        _state["model"] = tiny_model("qwen2")
    return _state["model"]


def cluster():
    import ray
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    return ray


def pool():
    """The shared 2-worker pool, named POOL_NAME."""
    if "pool" not in _state:
        cluster()
        from rollout_service import start_pool
        _state["pool"] = start_pool(model(), num_workers=2, name=POOL_NAME, engine_kwargs=ENGINE_KWARGS)
    return _state["pool"]


def release(request: pytest.FixtureRequest, fixture_name: str = "service") -> None:
    """Shut everything down if no test after this module uses the shared fixture."""
    items = request.session.items
    users = [i for i, item in enumerate(items) if fixture_name in getattr(item, "fixturenames", ())]
    mine = [i for i, item in enumerate(items) if item.module is request.module]
    if users and mine and max(users) > max(mine):
        return
    if "pool" in _state:
        _state.pop("pool").shutdown()
    import ray
    if ray.is_initialized():
        ray.shutdown()
