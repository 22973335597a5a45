"""Weight pushes to a rollout pool (rollout_service.service.weight_sync: one WeightPush a push) on CPU: the
digest, bucket plans, the object-store and broadcast (gloo) transports, and what a refused, corrupted or
abandoned push leaves behind: every worker serving the weights it had, and a later correct push landing.

The GPU forms (NCCL broadcast, CUDA IPC between processes on one GPU) are in tests/gpu/test_weight_sync_gpu.py.
"""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

ray = pytest.importorskip("ray")

import service_shared as shared  # noqa: E402
from service_shared import ENGINE_KWARGS, assert_same  # noqa: E402

from recipes.fsdp_weights import iter_full_tensors  # noqa: E402
from rollout_service import Engine, SamplingParams, start_pool  # noqa: E402
from rollout_service.service.weight_sync import (WHOLE, SyncPlan, WeightPush, choose_transport,  # noqa: E402
                                                 fingerprint_entries, plan_buckets, stage_tensors, stages_whole)
from rollout_service.service.weight_sync.receiver import WeightReceiver  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.weights import (WeightMismatchError, model_digest, state_dict_digest,  # noqa: E402
                                     tensor_fingerprint)

# -- the digest --------------------------------------------------------------------------------------

_P = 2 ** 31 - 1


def _reference_fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """The fingerprint's definition in plain Python integers, element by element."""
    def weight(i: int, seed: int, bits: int = 20) -> int:
        x = (i * 48271 + seed) % _P
        x = (x * x + 12345) % _P
        x = (x * x + 67891) % _P
        return (x & ((1 << bits) - 1)) + 1
    bits = t.detach().reshape(-1).to(torch.bfloat16).view(torch.int16).tolist()
    lanes = []
    for seed in (0x2545F491, 0x61C88647):
        rows: dict[int, int] = {}
        for i, b in enumerate(bits):
            row, col = divmod(i, 1 << 14)
            rows[row] = rows.get(row, 0) + (b + 2 ** 15 + 1) * weight(col, seed, 14)  # b: the bits as int16
        lanes.append(sum((s % _P) * weight(r, seed) % _P for r, s in rows.items()) % _P)
    return lanes[0], lanes[1]


def test_fingerprint_is_its_exact_integer_definition():
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, (1 << 14) - 1, (1 << 14) + 5, 3 * (1 << 14)):
        t = torch.randn(n, generator=g).to(torch.bfloat16)
        assert tensor_fingerprint(t) == _reference_fingerprint(t), n
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40], dtype=torch.bfloat16)
    assert tensor_fingerprint(special) == _reference_fingerprint(special)


def test_fingerprint_sees_every_bit_and_position_and_only_bf16_bits():
    t = torch.randn(70_000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    base = tensor_fingerprint(t)
    flipped = t.clone()
    flipped.view(torch.int16)[12_345] ^= 1  # the lowest mantissa bit of one element
    swapped = t.clone()
    swapped[[10, 20_000]] = t[[20_000, 10]]
    assert tensor_fingerprint(flipped) != base and tensor_fingerprint(swapped) != base
    assert tensor_fingerprint(torch.zeros(5)) != tensor_fingerprint(torch.zeros(6))  # the length counts
    assert tensor_fingerprint(-torch.zeros(5)) != tensor_fingerprint(torch.zeros(5))  # so does the sign bit
    # the digest is of the bf16 bits: float32 masters digest like their bf16 copy, a bf16 step apart does not
    assert tensor_fingerprint(t.float()) == base
    assert tensor_fingerprint(t.float() * (1 + 2 ** -6)) != base


def _packed_case():
    """Tensors of awkward sizes packed at gaps in one buffer, one with a NaN and an inf."""
    g = torch.Generator().manual_seed(2)
    sizes = [5, (1 << 14) + 3, 0, 1, 2 * (1 << 14), 777]
    layout, at = [], 3
    for n in sizes:
        layout.append((at, n))
        at += n + 11
    buf = torch.randn(at, generator=g).to(torch.bfloat16)
    buf[layout[4][0] + 99] = float("nan")
    buf[layout[4][0] + 100] = float("inf")
    return buf, layout


def test_packed_fingerprints_are_each_tensors_fingerprint_and_count_non_finite():
    from rollout_service.weights import packed_fingerprints
    buf, layout = _packed_case()
    got = packed_fingerprints(buf, layout).tolist()
    for (o, n), (a, b, bad) in zip(layout, got):
        assert (a, b) == tensor_fingerprint(buf[o:o + n]) == _reference_fingerprint(buf[o:o + n])
        assert bad == int((~torch.isfinite(buf[o:o + n].float())).sum())
    assert [row[2] for row in got] == [0, 0, 0, 0, 2, 0]


def test_packed_fingerprints_through_the_triton_kernel_equal_the_hosts():
    """The CUDA path (one Triton launch for the rows of every tensor, then the row table's reduction)
    run in Triton's interpreter on CPU tensors, against the host's float64 matmuls."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    code = (
        "import torch, test_weight_sync as t, rollout_service.weights as w\n"
        "from kernels.triton.fingerprint import fingerprint_row_sums\n"
        "buf, layout = t._packed_case()\n"
        "host = w.packed_fingerprints(buf, layout).tolist()\n"
        "w._triton_row_sums = lambda device: fingerprint_row_sums\n"
        "kernel = w.packed_fingerprints(buf, layout).tolist()\n"
        "assert kernel == host, (kernel, host)\n"
        "flipped = buf.clone(); flipped.view(torch.int16)[layout[1][0] + 70] ^= 1\n"
        "other = w.packed_fingerprints(flipped, layout).tolist()\n"
        "assert [r != s for r, s in zip(other, kernel)] == [False, True, False, False, False, False]\n"
        "print('ok')\n")
    here = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_sender_check_packs_buckets_and_names_what_is_not_finite():
    sd = tiny_model("qwen2").state_dict()
    named = list(sd.items())
    whole = fingerprint_entries(named)
    for bucket_bytes in (1 << 10, 64 << 10):  # many buckets, tensors larger than a bucket among them
        assert fingerprint_entries(named, bucket_bytes) == whole
    assert [fp for _, _, fp, _ in whole] == [tensor_fingerprint(t) for _, t in named]
    name = "model.layers.0.mlp.up_proj.weight"
    broken = {**sd, name: sd[name].clone()}
    broken[name][0, 0] = float("inf")
    with pytest.raises(WeightMismatchError, match="finite") as e:
        fingerprint_entries(broken.items(), 1 << 10)
    assert name in str(e.value) and "down_proj" not in str(e.value)
    with pytest.raises(WeightMismatchError, match="finite"):
        fingerprint_entries([*named, ("step", torch.tensor([3]))])


def test_staged_pass_checks_what_the_check_pass_checks():
    """The staged pass (one pass into a buffer of the whole push) gives the check pass's rows and refusals."""
    sd = tiny_model("qwen2").state_dict()
    named = list(sd.items())
    numel = sum(t.numel() for t in sd.values())
    stage, entries = stage_tensors(named, numel, None)
    assert entries == fingerprint_entries(named) and stage.numel() == numel
    # float32 master weights cast by the stage's copy: the bits of a bf16 copy made first (.to)
    master = list(tiny_model("qwen2", dtype=torch.float32).state_dict().items())
    cast, _ = stage_tensors(master, numel, None)
    rounded, _ = stage_tensors([(n, t.to(torch.bfloat16)) for n, t in master], numel, None)
    assert torch.equal(cast.view(torch.int16), rounded.view(torch.int16))
    assert not torch.equal(cast.float(), torch.cat([t.reshape(-1) for _, t in master]))  # it rounds
    name = "model.layers.0.mlp.up_proj.weight"
    broken = {**sd, name: sd[name].clone()}
    broken[name][1, 2] = float("nan")
    with pytest.raises(WeightMismatchError, match="finite") as e:
        stage_tensors(broken.items(), numel, None)
    assert name in str(e.value) and "down_proj" not in str(e.value)
    with pytest.raises(WeightMismatchError, match="step"):
        stage_tensors([*named, ("step", torch.tensor([3]))], numel, None)
    for wrong in (numel - 1, numel + 1):
        with pytest.raises(ValueError, match="announced"):
            stage_tensors(named, wrong, None)
    assert stages_whole(numel, 2 * numel) and not stages_whole(numel, 2 * numel - 1)


def test_state_dict_digest_names_shapes_and_order():
    sd = tiny_model("qwen2").state_dict()
    digest = state_dict_digest(sd)
    assert digest == state_dict_digest(dict(reversed(list(sd.items()))))  # name order, not dict order
    assert digest == state_dict_digest({k: v.float() for k, v in sd.items()})
    name = "model.layers.0.mlp.up_proj.weight"
    assert digest != state_dict_digest({**sd, name: sd[name].reshape(-1)})  # same bits, other shape
    renamed = {("x." + k if k == name else k): v for k, v in sd.items()}
    assert digest != state_dict_digest(renamed)


def test_fsdp2_weights_on_one_rank_are_read_without_a_gather(gloo_group, monkeypatch):
    """An FSDP2 model on a one-rank mesh pushes its shards as they are (no collective, no DTensor
    dispatch): the same names and bf16 bits as the unsharded model, and full_tensor() never runs."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    model = tiny_model("qwen2", dtype=torch.float32)
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    for layer in model.model.layers:
        fully_shard(layer, mesh=gloo_group)
    fully_shard(model, mesh=gloo_group)
    assert all(isinstance(t, DTensor) for t in model.state_dict().values())

    def gathered(self, *args, **kwargs):
        raise AssertionError("full_tensor() ran on a one-rank mesh")
    monkeypatch.setattr(DTensor, "full_tensor", gathered)
    pushed = dict(iter_full_tensors(model))
    assert list(pushed) == list(expected)
    for name, t in expected.items():
        assert pushed[name].dtype == torch.bfloat16 and pushed[name].shape == t.shape
        assert torch.equal(pushed[name].view(torch.int16), t.view(torch.int16)), name


def test_bucket_plan():
    shapes = {"a": (4, 4), "b": (10,), "c": (100,), "d": (3,)}
    buckets = plan_buckets(shapes, bucket_bytes=2 * 30)  # 30 bf16 elements a bucket
    assert [[e.name for e in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [(e.offset, e.numel) for e in buckets[0]] == [(0, 16), (16, 10)]


@pytest.mark.parametrize("staged,bucket_bytes", [(True, WHOLE), (True, 64 << 10), (False, 64 << 10)],
                         ids=["staged-one-bucket", "staged-buckets", "streamed"])
def test_receiver_waits_for_the_engines_reads_only_where_the_buffer_is_reused(staged, bucket_bytes):
    """A staged push's buckets lie in one buffer of its own, so the engine may go on reading what it
    loaded (VLLMEngine's host copy); streamed, the one bucket buffer is written again, so the receiver
    waits for those reads after each bucket. Every tensor is still checked and loaded as sent."""
    sd = tiny_model("qwen2").state_dict()
    entries = fingerprint_entries(sd.items())
    shapes = {n: tuple(shape) for n, shape, _, _ in entries}
    plan = SyncPlan("broadcast", "unused", shapes, {n: fp for n, _, fp, _ in entries}, bucket_bytes, "cpu",
                    staged=staged)
    buckets = plan.buckets
    assert buckets == plan_buckets(shapes, bucket_bytes) and (len(buckets) == 1) == (bucket_bytes == WHOLE)
    shipped = SyncPlan.from_wire(plan.to_wire())  # derived on each side, not shipped
    assert shipped._buckets is None and shipped.buckets == buckets
    # a plan ships without its fingerprints and digest: they come with the go (header, or first ipc bucket)
    for transport in ("broadcast", "ipc"):
        moved = dataclasses.replace(plan, transport=transport)
        assert SyncPlan.from_wire(moved.to_wire()) == dataclasses.replace(moved, fingerprints=None, digest=None)
    with pytest.raises(ValueError, match="come with its go"):
        plan.check(shapes)
    with pytest.raises(TypeError, match="SyncPlan"):
        SyncPlan.from_wire(pickle.dumps(dict(shapes)))
    loaded, waits = {}, []
    receiver = WeightReceiver(plan, "cpu", lambda named: loaded.update((n, t.clone()) for n, t in named),
                              wait_reads=lambda: waits.append(len(loaded)))
    buf = torch.empty(plan.bucket_numel, dtype=torch.bfloat16)
    for index, bucket in enumerate(buckets):
        for e in bucket:
            buf[e.offset:e.offset + e.numel].copy_(sd[e.name].reshape(-1))
        receiver._take(index, buf)
    assert receiver.error is None and receiver.finish() == "unused"
    assert all(torch.equal(loaded[n], sd[n].to(torch.bfloat16)) for n in sd)
    assert len(waits) == (0 if staged else len(buckets))
    assert bucket_bytes == WHOLE or len(buckets) > 2


def test_transport_choice():
    cpu = torch.device("cpu")
    assert choose_transport("auto", cpu, [None, None]) == "object_store"
    assert choose_transport("broadcast", cpu, [None]) == "broadcast"
    with pytest.raises(ValueError, match="weight transport"):
        choose_transport("nccl", cpu, [None])


# -- pushes to a pool -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(request):
    shared.cluster()
    client = start_pool(shared.model(), num_workers=2, name="rollout-weight-sync", engine_kwargs=ENGINE_KWARGS)
    yield client
    client.shutdown()
    shared.release(request, "pool")


@pytest.fixture(scope="module")
def reqs():
    prompts = [[1, 2, 3], [4, 5], [7, 8, 9, 10], [11]]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in range(4)]
    return prompts, params


def _engine_rollouts(model, reqs):
    return Engine(model, **ENGINE_KWARGS).generate(*reqs)


def _worker_digests(pool):
    return [ray.get(w.weights_digest.remote()) for w in pool.workers()]


def _bad_pushes(sd):
    name = "model.layers.0.mlp.up_proj.weight"
    return [({**sd, name: torch.zeros(3, 3, dtype=torch.bfloat16)}, {}, "wrong shape"),
            ({k: v for k, v in sd.items() if k != name}, {}, "missing"),
            ({**sd, name: torch.full_like(sd[name], float("nan"))}, {}, "finite"),
            (sd, {"expected_digest": "0" * 32}, "expected 0000")]


@pytest.mark.parametrize("transport,stage_bytes,bucket_bytes", [
    ("object_store", 0, None), ("broadcast", 1 << 30, None), ("broadcast", 1 << 30, 64 << 10), ("broadcast", 0, None)],
    ids=["object_store", "broadcast-staged", "broadcast-staged-buckets", "broadcast-streamed"])
def test_push_lands_bitwise_and_refused_pushes_change_nothing(pool, reqs, transport, stage_bytes, bucket_bytes):
    old, new = shared.model(), tiny_model("qwen2", seed=2)
    before = _engine_rollouts(old, reqs)
    after = _engine_rollouts(new, reqs)
    assert [r.token_ids for r in before] != [r.token_ids for r in after]  # the weights matter

    sd = new.state_dict()
    sizes = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}  # several buckets of a staged push
    for bad, kwargs, words in _bad_pushes(sd):
        with pytest.raises(WeightMismatchError, match=words):
            pool.update_weights(bad, transport=transport, stage_bytes=stage_bytes, **sizes, **kwargs)
        # refused before any worker loaded anything: the old weights keep serving
        assert pool.weights_digest() == model_digest(old) and _worker_digests(pool) == [model_digest(old)] * 2
        assert_same(pool.generate(*reqs), before, f"after a refused {transport} push ({words})")
    assert all(w["state"] == "ready" and w["restarts"] == 0 for w in pool.stats()["workers"])

    push = dict(transport=transport, stage_bytes=stage_bytes, **sizes)
    assert pool.update_weights(sd, **push) == state_dict_digest(sd) == model_digest(new)
    assert _worker_digests(pool) == [model_digest(new)] * 2
    assert_same(pool.generate(*reqs), after, f"after a {transport} push")
    assert pool.update_weights(old.state_dict(), **push) == model_digest(old)  # and back
    assert_same(pool.generate(*reqs), before, f"back on the old weights by {transport}")


def test_ipc_has_no_cpu_form(pool):
    with pytest.raises(ValueError, match="object store"):
        pool.update_weights(shared.model().state_dict(), transport="ipc")
    assert pool.weights_digest() == model_digest(shared.model())


def _corrupted_push(pool, named, staged: bool = False):
    """A sender whose bits differ from the fingerprints it announced (a broken transfer), in its last
    bucket: every worker loads the buckets before it, then refuses, and the pool restarts them.
    Staged, the stage is altered after its fingerprints were taken."""
    restarts = [w["restarts"] for w in pool.stats()["workers"]]
    push = WeightPush(pool, "broadcast", bucket_bytes=64 << 10)  # several buckets
    if staged:
        push.check(named, sum(t.numel() for _, t in named))
        last_bucket = sum(b[-1].offset + b[-1].numel for b in push.plan.buckets[:-1])
        push._stage[last_bucket] += 1
    else:
        push.check(named)
    assert len(push.plan.buckets) > 2
    last = push.plan.buckets[-1][0].name
    with pytest.raises(RuntimeError, match="no worker loaded"):
        push.send(None if staged else [(n, t + 1 if n == last else t) for n, t in named])
    shared_wait(lambda: [w["restarts"] for w in pool.stats()["workers"]] == [r + 1 for r in restarts]
                and all(w["state"] in ("ready", "stale") for w in pool.stats()["workers"]), "the restarts",
                pool=pool)


@pytest.mark.parametrize("staged", [False, True], ids=["streamed", "staged"])
def test_corrupted_transfer_is_caught_and_the_pool_keeps_its_weights(pool, reqs, staged):
    """After a push through the object store the pool holds those weights: workers that a broken
    transfer left half-loaded come back with them."""
    old, new = shared.model(), tiny_model("qwen2", seed=2)
    before = _engine_rollouts(old, reqs)
    pool.update_weights(old.state_dict(), transport="object_store")
    _corrupted_push(pool, list(new.state_dict().items()), staged)
    assert [w["state"] for w in pool.stats()["workers"]] == ["ready", "ready"]
    assert pool.weights_digest() == model_digest(old) and _worker_digests(pool) == [model_digest(old)] * 2
    assert_same(pool.generate(*reqs), before, "after a corrupted push")
    assert pool.update_weights(new.state_dict(), transport="broadcast") == model_digest(new)  # a good one lands


def test_a_push_abandoned_after_begin_leaves_the_pool_serving_its_weights(pool, reqs):
    """A sender that gives up after the pool's begin (the trainer failed before sending) leaves every
    worker waiting in a broadcast that never comes: the pool restarts them with the weights it holds
    (here pushed through the object store), and serves those as before; the next push lands."""
    old, new = shared.model(), tiny_model("qwen2", seed=2)
    before = _engine_rollouts(old, reqs)
    pool.update_weights(old.state_dict(), transport="object_store")
    restarts = [w["restarts"] for w in pool.stats()["workers"]]
    named = list(new.state_dict().items())
    push = WeightPush(pool, "broadcast")
    push.check(named, sum(t.numel() for _, t in named))
    push.cancel("the trainer stopped before sending")
    shared_wait(lambda: [w["restarts"] for w in pool.stats()["workers"]] == [r + 1 for r in restarts]
                and all(w["state"] == "ready" for w in pool.stats()["workers"]), "the restarts", pool=pool)
    assert pool.weights_digest() == model_digest(old) and _worker_digests(pool) == [model_digest(old)] * 2
    assert_same(pool.generate(*reqs), before, "after an abandoned push")
    assert pool.update_weights(new.state_dict(), transport="broadcast") == model_digest(new)
    assert pool.update_weights(old.state_dict()) == model_digest(old)


def _ipc_begin(pool, model, timeout_s: float = 300.0) -> tuple[SyncPlan, list, list]:
    """The pool's begin of a staged ipc push of `model` (its plan, the workers, the go's fingerprints),
    asked as WeightPush asks it: ipc has no CPU form, so no sender makes one here, but the pool and
    its workers run the push's protocol up to the first bucket, which a CPU worker refuses."""
    named = list(model.state_dict().items())
    plan = SyncPlan("ipc", None, {n: tuple(t.shape) for n, t in named}, None, WHOLE, "cpu",
                    timeout_s=timeout_s, staged=True)
    info = pool._begin_weight_sync(plan)
    return plan, info["workers"], [fp for _, _, fp, _ in fingerprint_entries(named)]


def test_an_ipc_push_not_completed_is_abandoned_and_the_pool_keeps_its_weights(pool, reqs):
    """The pool asks each worker for an ipc push's end at begin, answered once the last bucket is taken.
    A push that does not get there ends with every worker told that no bucket will come: declined
    before its go, a bucket the worker refused, or a sender that asks for the verdict too early. Each
    time every worker answers having loaded nothing, none is restarted, and the pool serves the
    weights it had; then a push lands."""
    old, new = shared.model(), tiny_model("qwen2", seed=2)
    before = _engine_rollouts(old, reqs)
    pool.update_weights(old.state_dict(), transport="object_store")
    restarts = [w["restarts"] for w in pool.stats()["workers"]]

    plan, workers, _ = _ipc_begin(pool, new)
    with pytest.raises(RuntimeError, match="abandoned: the sender's checks refused"):
        pool._end_weight_sync(plan.sync_id, error="the sender's checks refused the push", declined=True)

    plan, workers, prints = _ipc_begin(pool, new)
    with pytest.raises(ValueError, match="sender's GPU"):  # the go, refused where it cannot be opened
        ray.get([w.receive_weight_bucket.remote(plan.sync_id, 0, None, prints) for w in workers])
    with pytest.raises(RuntimeError, match="abandoned: refused"):
        pool._end_weight_sync(plan.sync_id, error="refused")

    plan, workers, _ = _ipc_begin(pool, new, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="before its last bucket reached every worker"):
        pool._end_weight_sync(plan.sync_id, digest=model_digest(new))

    assert [w["restarts"] for w in pool.stats()["workers"]] == restarts
    assert all(w["state"] == "ready" for w in pool.stats()["workers"])
    assert pool.weights_digest() == model_digest(old) and _worker_digests(pool) == [model_digest(old)] * 2
    assert_same(pool.generate(*reqs), before, "after ipc pushes that were not completed")
    assert pool.update_weights(new.state_dict(), transport="broadcast") == model_digest(new)
    assert pool.update_weights(old.state_dict()) == model_digest(old)


def test_corrupted_transfer_after_a_worker_to_worker_push_waits_for_the_next_push(pool, reqs):
    """After a broadcast push no copy of the weights outlives the workers: when a broken transfer
    leaves every worker half-loaded, they come back "stale" (alive, serving nothing, saying why) and
    the next push makes them serve again."""
    new, newer = tiny_model("qwen2", seed=2), tiny_model("qwen2", seed=4)
    pool.update_weights(new.state_dict(), transport="broadcast")
    _corrupted_push(pool, list(newer.state_dict().items()))
    stats = pool.stats()["workers"]
    assert [w["state"] for w in stats] == ["stale", "stale"]
    assert all("waiting for the next weight push" in w["error"] for w in stats)
    [r] = pool.generate(reqs[0][:1], reqs[1][:1])
    assert r.finish_reason == "error" and "waiting for the next weight push" in r.error
    assert pool.update_weights(newer.state_dict(), transport="broadcast") == model_digest(newer)
    assert [w["state"] for w in pool.stats()["workers"]] == ["ready", "ready"]
    assert_same(pool.generate(*reqs), _engine_rollouts(newer, reqs), "after the next push")
    assert pool.update_weights(shared.model().state_dict()) == model_digest(shared.model())


def _broadcast(pool, model) -> bool:
    """Push by broadcast; returns whether the push set up a new process group."""
    named = list(model.state_dict().items())
    push = WeightPush(pool, "broadcast")
    push.check(named)
    assert push.send(named) == model_digest(model)
    return push.plan.new_group


def test_broadcast_group_is_kept_until_its_members_change_and_a_restart_copies_a_peer(pool, reqs):
    new = tiny_model("qwen2", seed=3)
    want = _engine_rollouts(new, reqs)
    _broadcast(pool, shared.model())
    assert not _broadcast(pool, new)  # same sender process, same workers: the group is reused
    restarts = pool.stats()["workers"][0]["restarts"]
    ray.kill(pool.workers()[0])
    shared_wait(lambda: pool.stats()["workers"][0]["restarts"] == restarts + 1
                and pool.stats()["workers"][0]["state"] == "ready", "the restart")
    assert _worker_digests(pool) == [model_digest(new)] * 2  # copied from the other worker
    assert_same(pool.generate(*reqs), want, "after the restart")
    assert _broadcast(pool, shared.model())  # a new member: a new group
    assert not _broadcast(pool, shared.model())
    other = start_pool(shared.model(), num_workers=1, name="rollout-weight-sync-2", engine_kwargs=ENGINE_KWARGS)
    try:  # one sender, two pools: each keeps its own group
        assert _broadcast(other, new) and not _broadcast(other, new)
        assert not _broadcast(pool, shared.model())
    finally:
        other.shutdown()


def shared_wait(cond, what: str, timeout: float = 120.0, pool=None):
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {pool.stats() if pool else ''}")
        time.sleep(0.1)


def test_start_pool_checks_the_model_at_the_call(pool, tmp_path):
    """A bad path, config or truncated checkpoint raises a one-line error at once, before any actor starts."""
    import time
    tiny_model("qwen2").save_pretrained(tmp_path / "ok")
    weights = next((tmp_path / "ok").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-64])
    (tmp_path / "no_config").mkdir()
    cases = [("/no/such/path", FileNotFoundError, "not a local directory"),
             (str(tmp_path / "ok"), ValueError, "truncated"),
             (str(tmp_path / "no_config"), ValueError, "config does not load"),
             ("tiny:gpt2", ValueError, "unknown tiny model")]
    for model, error, words in cases:
        t = time.monotonic()
        with pytest.raises(error, match=words) as info:
            start_pool(model, num_workers=1, name="rollout-bad-model")
        assert time.monotonic() - t < 5 and "\n" not in str(info.value)
    with pytest.raises(ValueError):
        ray.get_actor("rollout-bad-model", namespace="rollout_service")  # no pool actor was made


def test_copy_group_casts_as_copy_does_and_a_destination_written_twice_ends_with_the_later():
    from rollout_service.weights import CopyGroup
    gen = torch.Generator().manual_seed(5)
    src = torch.randn(3000, generator=gen) * 1e3  # float32 with bits below bf16's: the cast rounds them
    stage = torch.empty(3000, dtype=torch.bfloat16)
    tied = torch.zeros(8)
    group = CopyGroup(max_bytes=4000)  # flushes on the way, as the stage's groups do
    for start in range(0, 3000, 500):
        group.add(stage[start:start + 500], src[start:start + 500])
    group.add(tied, torch.ones(8))
    group.add(tied, torch.full((8,), 2.0))
    group.flush()
    assert torch.equal(stage, src.to(torch.bfloat16)) and not torch.equal(stage.float(), src)
    assert torch.equal(tied, torch.full((8,), 2.0))


def test_a_trainer_rank_keeps_its_transport_until_a_push_is_refused(pool):
    """A trainer rank (a Ray actor, as TrainerGroup starts it) is handed the pool (its client, not its
    name), keeps the transport it chose between pushes, drops it when a push is refused before sending
    (here: a non-finite weight), and chooses again for the next push, which lands."""
    from recipes.trainer import TrainerRank

    @ray.remote(num_cpus=0)
    class Rank(TrainerRank):
        def transport(self):  # the transport it holds for a pool (None: dropped)
            kept = self.weight_push._transport
            return None if kept is None else kept[1]

        def set_first_weight(self, value: float | None) -> None:  # None: as it was, then halved
            param = next(self.model.parameters())
            with torch.no_grad():
                if value is None:
                    param.copy_(self._kept.mul_(0.5))
                else:
                    self._kept = param.detach().clone()
                    param.fill_(value)

    rank = Rank.remote(0, 1, _rank_config(), 1.0)
    try:
        ray.get(rank.setup.remote(*ray.get(rank.address.remote()), tiny_model("qwen2", seed=2)))
        first = ray.get(rank.push_weights.remote(pool))
        assert first["pool_digest"] == first["digest"] and first["transport"] == "broadcast"
        assert ray.get(rank.transport.remote()) == "broadcast"
        assert ray.get(rank.push_weights.remote(pool))["pool_digest"] == first["digest"]
        assert ray.get(rank.transport.remote()) == "broadcast"  # kept: no transport choice

        ray.get(rank.set_first_weight.remote(float("nan")))
        with pytest.raises(WeightMismatchError, match="finite"):
            ray.get(rank.push_weights.remote(pool))
        assert ray.get(rank.transport.remote()) is None
        assert pool.weights_digest() == first["digest"]  # refused before sending: nothing changed

        ray.get(rank.set_first_weight.remote(None))  # finite again, and new weights
        again = ray.get(rank.push_weights.remote(pool))
        assert again["pool_digest"] == again["digest"] != first["digest"]
        assert ray.get(rank.transport.remote()) == "broadcast" and pool.weights_digest() == again["digest"]
    finally:
        ray.get(rank.close.remote())
        ray.kill(rank)


def _rank_config(**push):
    """One trainer rank, pushing by broadcast."""
    from recipes.config import TrainerConfig, WeightPushConfig
    return TrainerConfig(num_ranks=1, weight_push=WeightPushConfig(transport="broadcast", **push))


def _restarts(pool):
    return [w["restarts"] for w in pool.stats()["workers"]]


def test_a_trainer_closed_with_an_armed_push_releases_its_workers(pool, reqs):
    """A trainer rank closed after a train step that armed a push, the push never sent: its workers go
    back to serving at once, none restarted, not after the push's timeout (300 s)."""
    import concurrent.futures

    from bench.grpo_train_step import batch
    from recipes.trainer import TrainerRank

    old = shared.model()
    before = _engine_rollouts(old, reqs)
    rank = ray.remote(num_cpus=0)(TrainerRank).remote(0, 1, _rank_config(), 1.0)
    try:
        ray.get(rank.setup.remote(*ray.get(rank.address.remote()), old))
        assert ray.get(rank.push_weights.remote(pool))["pool_digest"] == model_digest(old)
        restarts = _restarts(pool)
        plans, tokens = batch(old.config.vocab_size, 2, 2)
        ray.get(rank.train_step.remote(plans[0], tokens, (), pool))  # armed, not sent
        ray.get(rank.close.remote())
        # served at once: with the push still armed the pool would hold every request until its timeout
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            assert_same(ex.submit(pool.generate, *reqs).result(timeout=60), before, "after the trainer closed")
        assert _restarts(pool) == restarts and pool.weights_digest() == model_digest(old)
    finally:
        ray.kill(rank)


@pytest.mark.slow
def test_a_train_step_longer_than_the_push_timeout_declines_its_armed_push(pool, reqs):
    """An armed push's workers wait for it through the train step, and give it up at the push's timeout.
    Control: a sender armed with a 4 s timeout and held 16 s loses its push (its store waits for
    workers that gave up: an error that says so), its workers restart, and the pool serves the
    weights it had. A trainer rank whose step outlasts half of trainer.weight_push_timeout_s declines
    its armed push first: the workers go back to serving, none restarted, and the push after the step
    goes unarmed and lands. A short step's push is still armed."""
    import time

    from torch.distributed import DistStoreError

    from bench.grpo_train_step import batch
    from recipes.trainer import TrainerRank

    old, new = shared.model(), tiny_model("qwen2", seed=2)
    before = _engine_rollouts(old, reqs)
    assert pool.update_weights(old.state_dict()) == model_digest(old)
    named = list(new.state_dict().items())
    restarts = _restarts(pool)
    push = WeightPush(pool, "broadcast", timeout_s=4.0)
    push.announce({n: tuple(t.shape) for n, t in named}, torch.device("cpu"), staged=True)
    time.sleep(16.0)  # four times the timeout: the workers have given up, however slowly they began
    with pytest.raises(RuntimeError, match="gave the push up after its 4 s timeout") as refused:
        push.check(named, sum(t.numel() for _, t in named))
        push.send()
    assert isinstance(refused.value.__cause__, DistStoreError)  # the sender's store waited for them in vain
    shared_wait(lambda: _restarts(pool) == [r + 1 for r in restarts]
                and all(w["state"] == "ready" for w in pool.stats()["workers"]), "the restarts", pool=pool)
    assert pool.weights_digest() == model_digest(old) and _worker_digests(pool) == [model_digest(old)] * 2
    assert_same(pool.generate(*reqs), before, "after an armed push timed out")

    @ray.remote(num_cpus=0)
    class Rank(TrainerRank):
        delay_s = 0.0

        def set_delay(self, seconds: float) -> None:
            self.delay_s = seconds

        def _train_step(self, *args):  # the same step, made longer than the push's timeout
            time.sleep(self.delay_s)
            return super()._train_step(*args)

    cfg = _rank_config(timeout_s=4.0)
    rank = Rank.remote(0, 1, cfg, 1.0)
    try:
        ray.get(rank.setup.remote(*ray.get(rank.address.remote()), new))
        assert ray.get(rank.push_weights.remote(pool))["transport"] == "broadcast"
        restarts = _restarts(pool)
        plans, tokens = batch(new.config.vocab_size, 2, 2)
        for delay_s, armed in ((8.0, False), (0.0, True)):
            ray.get(rank.set_delay.remote(delay_s))
            step = rank.train_step.remote(plans[0], tokens, (), pool)
            pushed = rank.push_weights.remote(pool, False, True)
            ray.get(step)
            result = ray.get(pushed)
            assert ("armed_ahead" in result["phases"]) == armed, (delay_s, result["phases"])
            assert result["pool_digest"] == result["digest"] and _worker_digests(pool) == [result["digest"]] * 2
            assert _restarts(pool) == restarts and all(w["state"] == "ready" for w in pool.stats()["workers"])
    finally:
        ray.get(rank.close.remote())
        ray.kill(rank)
    assert pool.update_weights(old.state_dict()) == model_digest(old)


def test_an_armed_push_lands_and_one_its_sender_then_refuses_loads_nothing(pool, reqs):
    """A broadcast push armed before its tensors exist (WeightPush.announce: the pool drains and its
    workers wait in the group) lands bitwise. When the sender's checks then refuse the push (the
    expected digest; tensors other than those armed for), the header's no-go sends every worker back
    to serving with nothing loaded: no restart, the group kept, and the next armed push lands in it."""
    old, new = shared.model(), tiny_model("qwen2", seed=2)
    before, after = _engine_rollouts(old, reqs), _engine_rollouts(new, reqs)
    assert pool.update_weights(old.state_dict(), transport="broadcast") == model_digest(old)
    restarts = _restarts(pool)
    named = list(new.state_dict().items())
    shapes = {n: tuple(t.shape) for n, t in named}
    numel = sum(t.numel() for _, t in named)

    def armed():
        push = WeightPush(pool, "broadcast")
        push.announce(shapes, torch.device("cpu"), staged=True)
        assert push.armed
        return push

    missing = named[:-1]
    refusals = [(named, {"expected_digest": "0" * 32}, WeightMismatchError, "expected 0000"),
                (missing, {}, ValueError, "not the ones it was armed for")]
    for tensors, kwargs, error, words in refusals:
        push = armed()
        with pytest.raises(error, match=words):
            push.check(tensors, sum(t.numel() for _, t in tensors), **kwargs)
        assert not push.armed
        assert pool.weights_digest() == model_digest(old) and _worker_digests(pool) == [model_digest(old)] * 2
        assert _restarts(pool) == restarts and all(w["state"] == "ready" for w in pool.stats()["workers"])
        assert_same(pool.generate(*reqs), before, f"after an armed push refused ({words})")

    push = armed()
    push.check(named, numel)
    assert not push.plan.new_group  # the refusals kept the group: every member took their no-go
    assert push.seconds["armed_ahead"] > 0.0
    assert push.send() == model_digest(new) and _worker_digests(pool) == [model_digest(new)] * 2
    assert_same(pool.generate(*reqs), after, "after an armed push")
    assert _restarts(pool) == restarts
    assert pool.update_weights(old.state_dict()) == model_digest(old)


def test_a_push_queued_behind_a_failed_train_step_is_declined_and_not_sent(pool):
    """A trainer rank arms the push that follows its train step (train_step's arm); when the step
    fails, the armed push is declined (the workers go back to serving, none restarted) and the push
    queued behind the step refuses to send. The next push lands."""
    from recipes.trainer import TrainerRank

    rank = ray.remote(num_cpus=0)(TrainerRank).remote(0, 1, _rank_config(), 1.0)
    try:
        ray.get(rank.setup.remote(*ray.get(rank.address.remote()), tiny_model("qwen2", seed=2)))
        first = ray.get(rank.push_weights.remote(pool))  # the transport, kept
        assert first["pool_digest"] == first["digest"] and first["transport"] == "broadcast"
        restarts = _restarts(pool)
        step = rank.train_step.remote([[{}]], [1], (), pool)  # no batch: it fails
        queued = rank.push_weights.remote(pool, False, True)
        with pytest.raises(ray.exceptions.RayTaskError, match="KeyError"):
            ray.get(step)
        with pytest.raises(RuntimeError, match="train step before this push failed"):
            ray.get(queued)
        assert pool.weights_digest() == first["digest"] and _worker_digests(pool) == [first["digest"]] * 2
        assert _restarts(pool) == restarts and all(w["state"] == "ready" for w in pool.stats()["workers"])
        again = ray.get(rank.push_weights.remote(pool))
        assert again["pool_digest"] == again["digest"] == first["digest"]
    finally:
        ray.get(rank.close.remote())
        ray.kill(rank)
    assert pool.update_weights(shared.model().state_dict()) == model_digest(shared.model())
