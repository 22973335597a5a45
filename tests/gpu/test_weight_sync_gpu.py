"""Weight pushes on GPUs: the digest computed on the GPU equals the CPU's, CUDA IPC into a worker on the
sender's GPU, NCCL broadcast to a worker on another GPU (when there are two), refusals that leave the
old weights serving, a corrupted transfer caught, a vLLM worker's host copy landing behind each push,
and the GRPO recipe pushing by IPC with KL 0."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ray = pytest.importorskip("ray")

from conftest import rollout_bits  # noqa: E402
from rollout_service import Engine, SamplingParams, start_pool  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.service.weight_sync import SenderStage, WeightPush, fingerprint_entries  # noqa: E402
from rollout_service.weights import (WeightMismatchError, model_digest, state_dict_digest,  # noqa: E402
                                     tensor_fingerprint)

ENGINE = {"device": "cuda", "kv_cache_tokens": 4096}
WORKER = {**ENGINE, "backend": "native"}


def _model(seed):
    return tiny_model("qwen2", seed=seed, hidden_size=256, intermediate_size=768, num_heads=8, num_kv_heads=2,
                      vocab_size=1024)


@pytest.fixture(scope="module")
def cluster():
    ray.init(include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_digest_on_the_gpu_equals_the_cpus():
    g = torch.Generator().manual_seed(0)
    for n in (1, 5000, (1 << 14) + 3, 20_000_000):
        t = torch.randn(n, generator=g).to(torch.bfloat16)
        assert tensor_fingerprint(t.cuda()) == tensor_fingerprint(t), n
    sd = _model(1).state_dict()
    assert state_dict_digest({k: v.cuda() for k, v in sd.items()}) == state_dict_digest(sd)
    # a bucket's tensors in one launch, non-finite values counted, as on the host
    from test_weight_sync import _packed_case
    from rollout_service.weights import packed_fingerprints
    buf, layout = _packed_case()
    assert packed_fingerprints(buf.cuda(), layout).tolist() == packed_fingerprints(buf, layout).tolist()
    named = list(sd.items())
    on_gpu = fingerprint_entries([(k, v.cuda()) for k, v in named], 64 << 10)
    assert [e[:3] for e in on_gpu] == [e[:3] for e in fingerprint_entries(named)]


def _reqs():
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9]]
    return prompts, [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(3)]


def _pool_on(cluster, separate: bool):
    if separate and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pool = start_pool(_model(0), num_workers=1, name=f"weight-sync-gpu-{separate}", engine_kwargs=WORKER,
                      resources_per_worker={"num_cpus": 1, "num_gpus": 1 if separate else 0.5})
    worker_gpu = pool.stats()["workers"][0]["gpu"]
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    mine = [i for i, u in enumerate(uuids) if (u != worker_gpu) == separate][0]
    torch.cuda.set_device(mine)
    return pool, torch.device("cuda", mine)


@pytest.mark.parametrize("separate", [False, True], ids=["ipc-same-gpu", "nccl-other-gpu"])
def test_push_on_gpus(cluster, separate):
    old, new = _model(0), _model(1)
    torch.cuda.set_device(0)  # the references on GPU 0; the engines are invariant to which GPU runs them
    want_old = Engine(old, **ENGINE).generate(*_reqs())
    want_new = Engine(new, **ENGINE).generate(*_reqs())
    assert [r.token_ids for r in want_old] != [r.token_ids for r in want_new]
    pool, device = _pool_on(cluster, separate)
    try:
        sd = {k: v.to(device) for k, v in new.state_dict().items()}
        name = "model.layers.0.mlp.up_proj.weight"
        for bad, kwargs, words in (({**sd, name: torch.full_like(sd[name], float("nan"))}, {}, "finite"),
                                   (sd, {"expected_digest": "0" * 32}, "expected 0000")):
            with pytest.raises(WeightMismatchError, match=words):
                pool.update_weights(bad, transport="auto", **kwargs)
            assert [rollout_bits(r) for r in pool.generate(*_reqs())] == [rollout_bits(r) for r in want_old]
        transport = "broadcast" if separate else "ipc"
        named = list(sd.items())
        # armed ahead: refused after arming, the no-go loads nothing; armed pushes land. From a kept stage
        # (the trainer's): by ipc the workers keep the buffer they opened, so a second push through the
        # same memory must land its own bits, not the first's
        shapes, numel = {n: tuple(t.shape) for n, t in named}, sum(t.numel() for _, t in named)
        kept = SenderStage()
        refused = WeightPush(pool, transport, stage=kept)
        refused.announce(shapes, device, staged=True)
        abandoned, abort = [], refused._abort
        refused._abort = lambda reason: (abandoned.append(reason), abort(reason))  # must not be reached
        with pytest.raises(WeightMismatchError, match="expected 0000"):
            refused.check(named, numel, "0" * 32)
        assert not abandoned, abandoned
        assert [(w["state"], w["restarts"]) for w in pool.stats()["workers"]] == [("ready", 0)]
        assert [rollout_bits(r) for r in pool.generate(*_reqs())] == [rollout_bits(r) for r in want_old]
        for model, want in ((new, want_new), (old, want_old), (new, want_new)):
            tensors = [(n, t.to(device)) for n, t in model.state_dict().items()]
            armed = WeightPush(pool, transport, stage=kept)
            armed.announce(shapes, device, staged=True)
            armed.check(tensors, numel)
            assert armed.send() == model_digest(model)
            assert not separate or not armed.plan.new_group  # broadcast: the no-go kept the group
            assert [rollout_bits(r) for r in pool.generate(*_reqs())] == [rollout_bits(r) for r in want]
        # back to the old weights through the object store, which a restart below reloads from
        assert pool.update_weights(old.state_dict(), transport="object_store") == model_digest(old)
        # a corrupted transfer: caught by the worker, which comes back with the old weights
        push = WeightPush(pool, transport, bucket_bytes=1 << 20)
        push.check(named)
        last = push.plan.buckets[-1][0].name
        with pytest.raises(Exception):  # ipc: the worker's refusal at that bucket; broadcast: the verdict
            push.send([(n, t + 1 if n == last else t) for n, t in named])
        _wait(lambda: pool.stats()["workers"][0]["state"] == "ready")
        assert pool.weights_digest() == model_digest(old)
        assert [rollout_bits(r) for r in pool.generate(*_reqs())] == [rollout_bits(r) for r in want_old]

        assert pool.update_weights(sd, transport="auto") == model_digest(new)
        assert pool.stats()["workers"][0]["restarts"] == 1
        assert [rollout_bits(r) for r in pool.generate(*_reqs())] == [rollout_bits(r) for r in want_new]
    finally:
        pool.shutdown()


@pytest.mark.parametrize("separate", [False, True], ids=["ipc-same-gpu", "nccl-other-gpu"])
def test_vllm_worker_host_copy_lands_behind_each_push(cluster, separate):
    """A vLLM worker's host copy of the weights (what restarts copy, and what a colocated engine reloads
    after sleeping at level 2) is written behind the push while rollouts go on. After staged pushes (the
    sender's buffers never written again) and a streamed one in small buckets (the one buffer reused, so
    each bucket's copy is waited for) it holds exactly what was pushed: the engine, its weights discarded
    by sleep and reloaded from the host copy, serves the same bits as straight after the push."""
    pytest.importorskip("vllm")
    if separate and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    models = [_model(s) for s in (0, 1, 2, 3)]
    pool = start_pool(models[0], num_workers=1, name=f"host-copy-gpu-{separate}",
                      engine_kwargs={"device": "cuda", "backend": "vllm", "gpu_memory_utilization": 0.2,
                                     "sleep_mode": True},
                      resources_per_worker={"num_cpus": 1, "num_gpus": 1 if separate else 0.5})
    try:
        worker_gpu = pool.stats()["workers"][0]["gpu"]
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        device = torch.device("cuda", [i for i, u in enumerate(uuids) if (u != worker_gpu) == separate][0])
        transport = "broadcast" if separate else "ipc"
        served = [[rollout_bits(r) for r in pool.generate(*_reqs())]]
        for model, stage_bytes in zip(models[1:], (1 << 30, 0, 1 << 30)):  # staged, streamed, staged
            sd = {k: v.to(device) for k, v in model.state_dict().items()}
            assert pool.update_weights(sd, transport=transport, bucket_bytes=64 << 10,
                                       stage_bytes=stage_bytes) == model_digest(model)
            served.append([rollout_bits(r) for r in pool.generate(*_reqs())])  # the host copy still landing
            assert served[-1] != served[-2]  # the push took effect
            pool.sleep()  # level 2: the engine's weights discarded; the next request reloads the host copy
            assert [rollout_bits(r) for r in pool.generate(*_reqs())] == served[-1]
    finally:
        pool.shutdown()


def _wait(cond, timeout=180.0):
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.parametrize("async_steps", [0, 1], ids=["sync", "async-sent-behind"])
def test_recipe_pushes_by_ipc_with_zero_kl(cluster, tmp_path, async_steps):
    """The recipe's pushes by IPC, staged; with asynchronous steps each is sent from its stage while the
    next step trains, and every step's KL to the behaviour version is still 0.0."""
    from pathlib import Path

    from recipes.config import load_config
    from recipes.grpo import run
    tiny = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "tiny.yaml"
    steps = 2 + async_steps
    cfg = load_config(tiny, [f"train.steps={steps}", f"train.async_steps={async_steps}",
                             "train.prompts_per_step=8", "warmup.steps=20",
                             "rollout.num_workers=1", "rollout.engine.device=cuda", "rollout.engine.backend=native",
                             "rollout.resources_per_worker.num_gpus=0.45", "trainer.num_ranks=1",
                             "trainer.device=cuda", "trainer.placement.resources_per_rank.num_gpus=0.45",
                             f"run_dir={tmp_path}", "metrics.wandb=false"])
    records = run(cfg, progress=False)["records"]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for rec in records:
        assert rec["rollout_train/kl"] == 0.0 and rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        assert rec["weights/transport"] == "ipc" and rec["weights/staged"]
    for rec in records[1:]:  # async: the last step's push was sent behind this step's training
        assert ("perf/sync_behind_send_s" in rec) == bool(async_steps), rec
