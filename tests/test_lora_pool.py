"""LoRA adapters on a rollout pool: adapter-only pushes by every CPU transport (object store, broadcast
staged and streamed), several adapters served at once with each request exact, refusals that change
nothing, and restarted workers that come back serving the adapters. (CUDA IPC: tests/gpu/test_lora_gpu.py.)"""
from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("peft")

import service_shared as shared  # noqa: E402
from lora_shared import ALL_LINEAR, ATTENTION, base_model, logprob_bits, rollout_scores, trained_adapter_model  # noqa: E402
from service_shared import ENGINE_KWARGS  # noqa: E402
from test_weight_sync import shared_wait  # noqa: E402

from rollout_service import SamplingParams, start_pool  # noqa: E402
from rollout_service.lora import AdapterError, LoraAdapter, adapter_from_model, push_digest, save_adapter  # noqa: E402
from rollout_service.service.weight_sync import WeightPush  # noqa: E402
from rollout_service.weights import WeightMismatchError  # noqa: E402

PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10], [11]]
TRANSPORTS = [("object_store", 0), ("broadcast", 1 << 30), ("broadcast", 0)]
TRANSPORT_IDS = ["object_store", "broadcast-staged", "broadcast-streamed"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-pool-base")
    shared.model().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapters(checkpoint):
    """Two adapters trained on the pool's base (PEFT through the canonical forward), and their trainers."""
    a = trained_adapter_model(checkpoint, 8, ATTENTION, seed=1)
    b = trained_adapter_model(checkpoint, 4, ALL_LINEAR, seed=2)
    return {"a": (a, adapter_from_model(a)), "b": (b, adapter_from_model(b))}


@pytest.fixture(scope="module")
def pool(request, checkpoint):
    shared.cluster()
    client = start_pool(str(checkpoint), num_workers=2, name="rollout-lora", engine_kwargs=ENGINE_KWARGS)
    yield client
    client.shutdown()
    shared.release(request, "pool")


def _params(adapter, seed):
    return SamplingParams(max_tokens=8, temperature=1.0, seed=seed, adapter=adapter)


def _served(pool, names):
    rollouts = pool.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(names))],
                             [_params(n, seed=i) for i, n in enumerate(names)])
    assert all(r.ok for r in rollouts), [r.error for r in rollouts]
    return rollouts


@pytest.mark.parametrize("transport,stage_bytes", TRANSPORTS, ids=TRANSPORT_IDS)
def test_adapter_push_serves_each_request_its_adapters_logprobs(pool, checkpoint, adapters, transport, stage_bytes):
    """Names of this transport's own, so that only its pushes can be serving them."""
    base_digest = pool.weights_digest()
    tag = f"{transport}-{stage_bytes}"
    for name, (_, adapter) in adapters.items():
        got = pool.load_adapter(f"{name}-{tag}", adapter, transport=transport, stage_bytes=stage_bytes,
                                expected_digest=push_digest(adapter.digest(), base_digest))
        assert got == push_digest(adapter.digest(), base_digest)
    served = pool.adapters()
    assert all(served[f"{n}-{tag}"] == a.digest() for n, (_, a) in adapters.items())
    assert pool.weights_digest() == base_digest  # the base did not move
    names = [f"a-{tag}", f"b-{tag}", None, f"a-{tag}", f"b-{tag}", None]
    rollouts = _served(pool, names)
    scorers = {f"{n}-{tag}": m for n, (m, _) in adapters.items()} | {None: base_model(checkpoint)}
    for name, rollout in zip(names, rollouts):
        assert logprob_bits([rollout]) == rollout_scores(scorers[name], [rollout]), name
    unknown = pool.generate([PROMPTS[0]], _params("c", seed=0))[0]
    assert not unknown.ok and "unknown adapter 'c'" in unknown.error


def test_only_the_adapter_travels(pool, adapters):
    _, adapter = adapters["a"]
    push = WeightPush(pool, "broadcast", adapter=("a", adapter.settings(), None))
    push.load(dict(adapter.tensors))
    assert set(push.plan.shapes) == set(adapter.tensors)
    sent = sum(torch.Size(s).numel() * 2 for s in push.plan.shapes.values())  # bf16 on the wire
    assert sent == sum(t.numel() for t in adapter.tensors.values()) * 2
    assert sent < sum(t.numel() * 2 for t in shared.model().state_dict().values()) / 2


def _variant(adapter: LoraAdapter, **changes) -> LoraAdapter:
    return LoraAdapter.from_settings({**adapter.settings(), **changes}, changes.pop("tensors", adapter.tensors))


@pytest.mark.parametrize("transport,stage_bytes", TRANSPORTS, ids=TRANSPORT_IDS)
def test_refused_adapters_change_nothing(pool, adapters, transport, stage_bytes):
    _, good = adapters["a"]
    pool.load_adapter("a", good)
    base_digest = pool.weights_digest()
    before = logprob_bits(_served(pool, ["a", None, "a"]))
    version = pool.stats()["weight_version"]
    q = "model.layers.0.self_attn.q_proj.lora_A.weight"
    nan = dict(good.tensors)
    nan[q] = torch.full_like(nan[q], float("nan"))
    bad = [
        (_variant(good, r=4), {}, "rank 4"),
        (_variant(good, target_modules=(*good.target_modules, "w1")), {}, "w1"),
        (_variant(good, tensors=nan), {}, "finite"),
        (good, {"expected_digest": "0" * 32}, "expected 0000"),
        (good, {"expected_digest": push_digest(good.digest(), "other base weights")}, "other base weights"),
    ]
    for adapter, kwargs, words in bad:
        with pytest.raises(WeightMismatchError, match=words) as caught:
            pool.load_adapter("a", adapter, transport=transport, stage_bytes=stage_bytes, **kwargs)
        assert isinstance(caught.value, AdapterError) or "finite" in words
        assert pool.stats()["weight_version"] == version
        assert pool.weights_digest() == base_digest and pool.adapters()["a"] == good.digest()
        assert logprob_bits(_served(pool, ["a", None, "a"])) == before, words
    assert all(w["state"] == "ready" and w["restarts"] == 0 for w in pool.stats()["workers"])


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_restarted_worker_serves_the_adapters_again(pool, adapters, transport):
    """object_store: the restart loads the pushed object; broadcast: it copies a ready peer's adapter."""
    _, adapter = adapters["b"]
    name = f"b-restart-{transport}"
    pool.load_adapter(name, adapter, transport=transport)
    want = logprob_bits(_served(pool, [name] * 4))
    restarts = pool.stats()["workers"][0]["restarts"]
    ray.kill(pool.workers()[0])
    shared_wait(lambda: pool.stats()["workers"][0]["restarts"] == restarts + 1
                and pool.stats()["workers"][0]["state"] == "ready", "the restart", pool=pool)
    assert ray.get(pool.workers()[0].adapter.remote(name)).digest() == adapter.digest()
    assert logprob_bits(_served(pool, [name] * 4)) == want


def test_a_peft_checkpoint_on_disk_loads_into_the_pool(pool, adapters, tmp_path, checkpoint):
    model, adapter = adapters["a"]
    path = save_adapter(adapter, tmp_path / "adapter")
    assert pool.load_adapter("from-disk", str(path)) == push_digest(adapter.digest(), pool.weights_digest())
    rollouts = _served(pool, ["from-disk"] * 3)
    assert logprob_bits(rollouts) == rollout_scores(model, rollouts)
