"""Tensor parallelism: TP = 1, 2, 4 and 8 give the same bits as the unsharded trainer (CPU, gloo).

One group of 4 processes runs every TP=4 and TP=2 case (TP=2 on ranks 0-1 in a subgroup), and one
group of 8 processes the TP=8 cases, on models with 8 KV heads (at the default tree width of 8 each
rank then holds one segment of every row-parallel product); the TP=1 references are computed here.
"""
from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kernels as K
import trainer_patch
from kernels.forward import CANONICAL_OPS, model_spec
from kernels.tp import check_tp, row_parallel_matmul, shard_model, supported_degrees, tp_ops
from rollout_service.tiny_models import tiny_model
from rollout_service import Engine, SamplingParams
from rollout_service.engine.kv_cache import KVCache
from rollout_service.engine.runner import Chunk, ModelRunner
from rollout_service.engine.tp import TPContext, TPEngine, TPFollower, free_port, init_tp_group
from rollout_service.weights import model_digest
from conftest import rollout_bits, same_bits

MODEL_KW = dict(num_heads=4, num_kv_heads=4, hidden_size=64, intermediate_size=128)
MODEL8_KW = dict(num_heads=8, num_kv_heads=8, hidden_size=64, intermediate_size=128)  # splits 8 ways
ENGINE_KW = dict(window=4, group=4, kv_cache_tokens=512, verified_decode="dvr")
SEQS = [[random.Random(i).randrange(96) for _ in range(n)] for i, n in enumerate((7, 12, 5))]
PROMPTS = [[random.Random(10 + i).randrange(96) for _ in range(n)] for i, n in enumerate((5, 9))]
PARAMS = [SamplingParams(max_tokens=8, temperature=t, seed=s, determinism=m)
          for m in ("verified", "invariant") for t, s in ((0.0, None), (0.7, 11))]
REQUESTS = ([p for p in PROMPTS for _ in PARAMS], PARAMS * len(PROMPTS))  # every prompt with every params
UPDATED = (PROMPTS[:1] * 2, PARAMS[:2])  # requests after a weight update
LAYER_SHAPE = (16, 512, 48)  # M, K, N of the row-parallel layer check
REPO = Path(__file__).resolve().parents[1]


def make_model(seed=3, **kw):
    return tiny_model("qwen2", seed=seed, **(kw or MODEL_KW))


def make_gqa_model(num_kv_heads=4):
    """Llama with 2 query heads per KV head and a vocabulary that 4 and 8 do not divide (padded lm_head)."""
    return tiny_model("llama", seed=5, num_heads=2 * num_kv_heads, num_kv_heads=num_kv_heads,
                      hidden_size=16 * num_kv_heads, intermediate_size=128, vocab_size=90)


def layer_inputs(n=LAYER_SHAPE[2]):
    g = torch.Generator().manual_seed(0)
    m, k, _ = LAYER_SHAPE
    return (torch.randn(m, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.05).bfloat16(),
            torch.randn(n, generator=g).bfloat16())


def verifier_logits(model, ops) -> list[torch.Tensor]:
    """Canonical logits for every position of SEQS, one batched forward over the paged cache."""
    cache = KVCache(model_spec(model), 8, 16, "cpu")
    chunks = [Chunk(s, 0, [i], len(s)) for i, s in enumerate(SEQS)]
    return ModelRunner(model, cache, ops, "cpu").forward(chunks)


def _run_group(model, model2, gqa, ctx: TPContext) -> dict:
    """Everything one TP group computes; every rank runs it, rank 0's results are kept."""
    k, rank = ctx.world_size, ctx.rank
    out = {}
    x, w, _ = layer_inputs()
    cols = slice(rank * x.shape[1] // k, (rank + 1) * x.shape[1] // k)
    for reduce in ("tree", "tree_scatter", "all_reduce"):
        out[f"layer_{reduce}"] = row_parallel_matmul(x[:, cols], w[:, cols].contiguous(), None, ctx.group,
                                                     reduce=reduce, out_dtype=torch.float32)
    try:  # the peer-to-peer tree reads GPU memory: refused on gloo, with the reason
        row_parallel_matmul(x[:, cols], w[:, cols].contiguous(), None, ctx.group, reduce="tree_p2p")
        out["p2p_error"] = None
    except ValueError as exc:
        out["p2p_error"] = str(exc)
    x, w, b = layer_inputs(n=LAYER_SHAPE[2] + 2)  # N not a multiple of k, and a bias: rounded once, to bf16
    out["layer_odd_tree_scatter"] = row_parallel_matmul(x[:, cols], w[:, cols].contiguous(), b, ctx.group,
                                                        reduce="tree_scatter")
    local = shard_model(model, rank, k)
    vocab = model.config.vocab_size
    out["logits_tree"] = verifier_logits(local, tp_ops(CANONICAL_OPS, ctx.group, vocab_size=vocab))
    out["logits_tree_scatter"] = verifier_logits(local, tp_ops(CANONICAL_OPS, ctx.group, vocab_size=vocab,
                                                               reduce="tree_scatter"))
    out["logits_bf16_all_reduce"] = verifier_logits(local, tp_ops(
        CANONICAL_OPS, ctx.group, vocab_size=vocab, reduce="all_reduce", reduce_dtype=torch.bfloat16))
    out["logits_gqa"] = verifier_logits(shard_model(gqa, rank, k), tp_ops(CANONICAL_OPS, ctx.group, vocab_size=90))
    if rank == 0:
        engine = TPEngine(model, ctx, **ENGINE_KW)
        assert engine.cache.k[0].shape[2] == model.config.num_key_value_heads // k  # local heads only
        out["rollouts"] = engine.generate(*REQUESTS)
        out["digest"] = engine.update_weights(model2.state_dict())
        out["rollouts_updated"] = engine.generate(*UPDATED)
        engine.close()
    else:
        TPFollower(model, ctx, **ENGINE_KW).serve_forever()
    return out


def _worker(rank, world, port, models, path):
    torch.set_num_threads(1)
    init_tp_group(rank, world, port)
    groups = {world: TPContext()}
    if world == 4:
        groups[2] = TPContext(dist.new_group([0, 1]))  # every rank takes part in creating a subgroup
    results = {k: _run_group(*models, ctx) for k, ctx in groups.items() if rank < k}
    if rank == 0:
        torch.save(results, path)
    dist.destroy_process_group()


def _run_tp_groups(world, models, tmp_path_factory) -> dict:
    """{k: rank 0's results} of the TP groups that `world` processes run."""
    path = tmp_path_factory.mktemp(f"tp{world}") / "results.pt"
    # fork: the children start with everything imported and the models in memory (spawning fresh
    # interpreters costs far more CPU than the test itself); spawn where fork does not exist
    ray = sys.modules.get("ray")
    forkable = "fork" in mp.get_all_start_methods() and not (ray is not None and ray.is_initialized())
    method = "fork" if forkable else "spawn"
    mp.start_processes(_worker, args=(world, free_port(), models, str(path)), nprocs=world, start_method=method)
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def models():
    return make_model(3), make_model(4), make_gqa_model()


@pytest.fixture(scope="module")
def models8():
    return make_model(3, **MODEL8_KW), make_model(4, **MODEL8_KW), make_gqa_model(num_kv_heads=8)


@pytest.fixture(scope="module")
def tp(models, tmp_path_factory):
    return _run_tp_groups(4, models, tmp_path_factory)


@pytest.fixture(scope="module")
def tp8(models8, tmp_path_factory):
    return _run_tp_groups(8, models8, tmp_path_factory)


@pytest.fixture(scope="module")
def tp1(models):
    return _tp1_reference(models)


@pytest.fixture(scope="module")
def tp1_8(models8):
    return _tp1_reference(models8)


@pytest.fixture(params=[2, 4, 8], ids=lambda k: f"tp{k}")
def case(request):
    """(k, the TP=k group's results, the TP=1 references, the models) for k = 2, 4 and 8."""
    k = request.param
    names = ("tp8", "tp1_8", "models8") if k == 8 else ("tp", "tp1", "models")
    results, reference, models = (request.getfixturevalue(name) for name in names)
    return k, results[k], reference, models


def _tp1_reference(models) -> dict:
    """TP=1: the unsharded engine and verifier, and the trainer's log-probs."""
    model, model2, _ = models
    engine = Engine(model, **ENGINE_KW)
    out = {"rollouts": engine.generate(*REQUESTS)}
    engine.update_weights(model2.state_dict())
    out["rollouts_updated"] = engine.generate(*UPDATED)
    out["logits"] = verifier_logits(model, CANONICAL_OPS)
    out["logits_tp_ops"] = verifier_logits(shard_model(model, 0, 1), tp_ops(CANONICAL_OPS))
    out["logits_gqa"] = verifier_logits(models[2], CANONICAL_OPS)
    x, w, _ = layer_inputs()
    out["layer"] = K.matmul(x, w, row_parallel=True, out_dtype=torch.float32)
    x, w, b = layer_inputs(n=LAYER_SHAPE[2] + 2)
    out["layer_odd"] = K.matmul(x, w, b, row_parallel=True)
    return out


def trainer_logprobs(model, seq, prompt_len=1, temperature=1.0):
    train = copy.deepcopy(model)  # token_logprobs patches the model it is given
    return trainer_patch.token_logprobs(train, torch.tensor([seq]), temperature=temperature)[0, prompt_len - 1:]


def test_row_parallel_tree_all_reduce_equals_tp1(case):
    _, got, tp1, _ = case
    assert same_bits(got["layer_tree"], tp1["layer"])


def test_tree_scatter_equals_tp1(case):
    """The tree's top levels split by columns (all-to-all, combine, all-gather of rounded columns):
    the TP=1 bits for the layer, with a bias and N not a multiple of k, and for the whole model."""
    _, got, tp1, _ = case
    assert same_bits(got["layer_tree_scatter"], tp1["layer"])
    assert got["layer_odd_tree_scatter"].dtype == torch.bfloat16
    assert same_bits(got["layer_odd_tree_scatter"], tp1["layer_odd"])
    assert all(same_bits(a, b) for a, b in zip(got["logits_tree_scatter"], tp1["logits"]))


def test_peer_tree_needs_cuda(case):
    _, got, _, _ = case
    assert "needs CUDA tensors" in got["p2p_error"], got["p2p_error"]


def test_plain_all_reduce_negative_control(tp, tp1, tp8, tp1_8):
    """Summing the ranks' fp32 subtree nodes with dist.all_reduce: at k=2 that is the tree's single root
    add (commutative, so exact); at k=4 and 8 gloo's ring associates differently from the tree."""
    assert same_bits(tp[2]["layer_all_reduce"], tp1["layer"])
    assert not same_bits(tp[4]["layer_all_reduce"], tp1["layer"])
    assert not same_bits(tp8[8]["layer_all_reduce"], tp1_8["layer"])
    # bf16 partials summed by all_reduce (what ordinary TP engines do) change the model's logits
    for k, got, want in ((2, tp[2], tp1), (4, tp[4], tp1), (8, tp8[8], tp1_8)):
        differ = [not same_bits(a, b) for a, b in zip(got["logits_bf16_all_reduce"], want["logits"])]
        assert any(differ), f"TP={k}: bf16 all_reduce gave the canonical logits"


def test_verifier_forward_at_tp1_equals_trainer(tp1, models):
    _check_verifier_logits(tp1["logits_tp_ops"], tp1, models[0], "TP=1")


def test_verifier_forward_equals_tp1_and_trainer(case):
    k, got, tp1, models = case
    _check_verifier_logits(got["logits_tree"], tp1, models[0], f"TP={k}")
    # GQA heads split across ranks, padded vocab shards
    assert all(same_bits(a, b) for a, b in zip(got["logits_gqa"], tp1["logits_gqa"])), f"TP={k}: GQA model"


def _check_verifier_logits(logits, tp1, model, label):
    for i, (got, want, seq) in enumerate(zip(logits, tp1["logits"], SEQS)):
        assert same_bits(got, want), f"{label} sequence {i}: logits differ"
        logp = K.log_softmax(got[:-1]).gather(1, torch.tensor(seq[1:]).unsqueeze(1)).squeeze(1)
        assert same_bits(logp, trainer_logprobs(model, seq)), f"{label} sequence {i}: log-probs differ"


def test_rollouts_equal_tp1_and_trainer(case):
    k, got_all, tp1, models = case
    n = len(PARAMS)
    for key in ("rollouts", "rollouts_updated"):
        got, want = got_all[key], tp1[key]
        assert [rollout_bits(r) for r in got] == [rollout_bits(r) for r in want], f"TP={k} {key}"
    for j, r in enumerate(got_all["rollouts"]):
        assert r.ok and len(r.token_ids) == 8
        assert (r.stats.verify_windows > 0) == (PARAMS[j % n].determinism == "verified")
        prompt, p = PROMPTS[j // n], PARAMS[j % n]
        train = trainer_logprobs(models[0], prompt + r.token_ids, len(prompt), p.temperature or 1.0)
        assert same_bits(torch.tensor(r.logprobs, dtype=torch.float32), train), f"TP={k} request {j}: KL != 0"
    assert got_all["digest"] == model_digest(models[1])


def test_sharding_rules():
    model = make_model()
    with pytest.raises(ValueError, match="divide tree_segments"):
        check_tp(model, 3)
    with pytest.raises(ValueError, match="heads"):
        check_tp(tiny_model("qwen2", num_heads=4, num_kv_heads=2), 4)
    with pytest.raises(ValueError, match="down_proj has K=100"):
        check_tp(tiny_model("qwen2", intermediate_size=100), 2)
    local = shard_model(model, 1, 4)
    spec = model_spec(local)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (1, 1, 16)
    attn = local.model.layers[0].self_attn
    full = model.model.layers[0].self_attn
    assert torch.equal(attn.q_proj.weight, full.q_proj.weight[16:32])
    assert torch.equal(attn.o_proj.weight, full.o_proj.weight[:, 16:32])
    assert local.lm_head.weight.shape == (24, 64) and local.model.embed_tokens.weight.shape == (96, 64)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)  # the original is untouched
    padded = shard_model(tiny_model("qwen2", vocab_size=90, **MODEL_KW), 3, 4).lm_head.weight
    assert padded.shape == (23, 64) and not padded[-2:].any()  # 90 rows padded to 92 with zeros



def test_tree_width_sets_the_supported_tp_degrees(tree_width):
    x = (torch.randn(16, 512, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
    w = (torch.randn(48, 512, generator=torch.Generator().manual_seed(6))).to(torch.bfloat16)
    tree = lambda: K.matmul(x, w, row_parallel=True, out_dtype=torch.float32)  # noqa: E731
    wide = tree()
    tree_width(4)
    assert K.canonical_config().tree_segments == 4 and supported_degrees() == (1, 2, 4)
    four = tree()
    # TP=2 at width 4: each rank's 2-segment subtree on its K half, then the top of the tree
    halves = [K.backend_for(x).matmul(x[:, h * 256:(h + 1) * 256], w[:, h * 256:(h + 1) * 256], None, segments=2,
                                      out_dtype=torch.float32) for h in (0, 1)]
    assert torch.equal(halves[0] + halves[1], four)
    check_tp(make_model(), 4)
    tree_width(1)  # no tree: row-parallel layers are the plain canonical matmul, TP=1 only
    plain = tree()
    assert torch.equal(plain, K.matmul(x, w, out_dtype=torch.float32))
    with pytest.raises(ValueError, match="divide tree_segments"):
        check_tp(make_model(), 2)
    # the width is part of the numbers: the widths give different rounding (the test above can fail)
    assert not torch.equal(wide, four) and not torch.equal(four, plain) and not torch.equal(wide, plain)
    for bad in (3, 16, 0, "8x", 2.0, True):
        with pytest.raises(ValueError, match="tree_segments must be one of"):
            tree_width(bad)
    assert K.tree_segments() == 1  # a refused value changes nothing


def test_tree_width_from_the_environment():
    code = "import kernels as K; print(K.tree_segments())"
    env = dict(os.environ, **{K.TREE_SEGMENTS_ENV: "2"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr
    env[K.TREE_SEGMENTS_ENV] = "6"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.returncode != 0 and "ZEROKL_TREE_SEGMENTS must be one of (1, 2, 4, 8)" in out.stderr


def test_ray_tp_group_equals_tp1(models, tp1, local_ray):
    """TP=2 as Ray actors in a placement group (gloo): same bits as TP=1, weight updates included."""
    from rollout_service.engine.tp import create_tp_group
    group = None
    try:
        group = create_tp_group(models[0], 2, ENGINE_KW)  # {"CPU": 1} bundles, gloo
        assert group.weights_digest() == model_digest(models[0])
        got = group.generate(*REQUESTS)
        assert [rollout_bits(r) for r in got] == [rollout_bits(r) for r in tp1["rollouts"]]
        assert group.update_weights(models[1].state_dict()) == model_digest(models[1])
        got = group.engine().generate(*UPDATED)
        assert [rollout_bits(r) for r in got] == [rollout_bits(r) for r in tp1["rollouts_updated"]]
    finally:
        if group is not None:
            group.shutdown()


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_rollout_pool_worker_as_tp_group_equals_tp1(models, tp1, local_ray):
    """A pool worker with tensor_parallel_size=2 (its ranks in a placement group) gives the
    TP=1 bits, before and after a weight update through the client."""
    from rollout_service import RolloutClient, start_pool
    pool = None
    try:
        pool = start_pool(models[0], num_workers=1, name="rollout-tp",
                           engine_kwargs={**ENGINE_KW, "tensor_parallel_size": 2},
                           resources_per_worker={"num_cpus": 0.5})
        client = RolloutClient("rollout-tp")
        got = client.generate(*REQUESTS)
        assert [rollout_bits(r) for r in got] == [rollout_bits(r) for r in tp1["rollouts"]]
        assert client.update_weights(models[1].state_dict()) == model_digest(models[1])
        got = client.generate(*UPDATED)
        assert [rollout_bits(r) for r in got] == [rollout_bits(r) for r in tp1["rollouts_updated"]]
    finally:
        if pool is not None:
            pool.shutdown()
