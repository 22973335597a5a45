"""Push modes with vLLM-plugin workers on a GPU, the engine users run (rollout_service/service/switch_modes.py):

- finish-then-switch: one worker finishes its long request on the old weights while the other, idle,
  switches at once and serves new requests on the new weights before the push returns;
- each token carries the version its worker held when the request was admitted, and its log-prob is
  the trainer's on the GPU under that version (control: the other version's differs);
- switch-in-flight is refused up front (vLLM keeps its running requests' KV across a load), and so are
  a wrong digest and a bucketed transport in a non-drain mode: the pool keeps its weights and version.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from transformers import AutoModelForCausalLM  # noqa: E402

from rollout_service import SamplingParams, WeightMismatchError, start_pool  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.weights import state_dict_digest  # noqa: E402
from vllm_shared import trainer_logprobs  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=768, num_heads=8, num_kv_heads=2, vocab_size=1024,
             max_positions=8192)
LONG = 6000  # tokens: still running on its worker while the push lands and the short requests finish
TEMPERATURE = 1.0
# two vLLM workers share the GPU; a fixed KV size each, so that neither's memory profile sees the other's
ENGINE = {"device": "cuda", "backend": "vllm", "gpu_memory_utilization": 0.2,
          "vllm_options": {"kv_cache_memory_bytes": 2 << 30}}


@pytest.fixture(scope="module")
def cluster():
    ray.init(include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """(checkpoint path, trainer model on the GPU, state dict) of two policies saved to disk."""
    out = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"policy{seed}")
        tiny_model("qwen2", seed=seed, **SHAPE).save_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        on_host = {k: v.clone() for k, v in model.state_dict().items()}  # as a trainer pushes by object store
        out.append((str(path), model.cuda(), on_host))
    return out


@pytest.fixture(scope="module")
def pool(cluster, policies):
    client = start_pool(policies[0][0], num_workers=2, name="switch-modes-gpu", engine_kwargs=ENGINE,
                        resources_per_worker={"num_cpus": 1, "num_gpus": 0.45}, start_timeout_s=600)
    yield client
    client.shutdown()


def _requests(n: int, max_tokens: int, first_seed: int):
    prompts = [[3 + i, 17, 40 + 5 * i] for i in range(n)]
    return prompts, [SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE, seed=first_seed + i)
                     for i in range(n)]


def _check(rollout, version: int, models: dict) -> None:
    """One version for the whole rollout, and the trainer's log-probs under it, bit for bit; the other
    version's differ."""
    assert set(rollout.weight_versions) == {version} and len(rollout.weight_versions) == len(rollout.token_ids)
    mine = trainer_logprobs(models[version], rollout.prompt_token_ids, rollout.token_ids, TEMPERATURE)
    assert rollout.logprobs == mine
    [other] = [m for v, m in models.items() if v != version]
    assert rollout.logprobs != trainer_logprobs(other, rollout.prompt_token_ids, rollout.token_ids, TEMPERATURE)


def test_finish_then_switch_with_vllm_workers(pool, policies):
    # a vLLM engine's capabilities() take no switch in flight: its workers report the other two modes
    assert [w["switch_modes"] for w in pool.info["workers"]] == [["drain", "finish-then-switch"]] * 2
    old_version = pool.stats()["weight_version"]
    models = {old_version: policies[0][1], old_version + 1: policies[1][1]}
    ref, _ = pool.submit(*_requests(1, LONG, first_seed=800))
    deadline = time.monotonic() + 60
    while pool.stats()["in_flight"] < 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.01)
    pushed = threading.Event()
    pusher = threading.Thread(target=lambda: (pool.update_weights(policies[1][2], mode="finish-then-switch"),
                                              pushed.set()))
    pusher.start()
    while all(w["weight_version"] == old_version for w in pool.stats()["workers"]):  # the idle worker switches
        assert time.monotonic() < deadline + 120, "no worker switched"
        time.sleep(0.01)
    short = pool.generate(*_requests(4, 8, first_seed=900), timeout=300)
    served_during_push = not pushed.is_set()
    pusher.join(timeout=600)
    [long] = ray.get(ref, timeout=600)

    assert long.ok and len(long.token_ids) == LONG
    _check(long, old_version, models)  # finished on its version
    for r in short:  # admitted after the push began: the new weights, on the worker that switched
        assert r.ok
        _check(r, old_version + 1, models)
    assert served_during_push, "new requests waited for the long one, as a drain push makes them"
    assert pool.stats()["weight_version"] == old_version + 1


def test_refused_pushes_keep_the_weights(pool, policies):
    digest, version = pool.weights_digest(), pool.stats()["weight_version"]
    before = pool.generate(*_requests(2, 16, first_seed=40))
    with pytest.raises(ValueError, match="switch-in-flight"):
        pool.update_weights(policies[0][2], mode="switch-in-flight")
    with pytest.raises(WeightMismatchError):
        pool.update_weights(policies[0][2], expected_digest="0" * 16, mode="finish-then-switch")
    with pytest.raises(ValueError, match="buckets"):
        pool.update_weights(policies[0][2], transport="ipc", mode="finish-then-switch")
    assert pool.weights_digest() == digest and pool.stats()["weight_version"] == version
    after = pool.generate(*_requests(2, 16, first_seed=40))
    assert [r.logprobs for r in after] == [r.logprobs for r in before]
    assert all(set(r.weight_versions) == {version} for r in after)
    # and a drain push by CUDA IPC, staged whole on this process's GPU, lands bitwise
    on_gpu = {k: v.cuda() for k, v in policies[0][2].items()}
    assert pool.update_weights(on_gpu, transport="ipc") == state_dict_digest(policies[0][2]) == pool.weights_digest()
    models = {version + 1: policies[0][1], version: policies[1][1]}
    for r in pool.generate(*_requests(2, 16, first_seed=40)):
        _check(r, version + 1, models)
