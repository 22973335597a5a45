"""GPU tensor parallelism of the native engine: TP = 2, 4 and 8 (as many as there are GPUs) equal TP = 1
and the trainer bit for bit, with tree width 8, on a tiny Qwen2 and on two layers of Llama-3.1-8B's
shapes (hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256; random weights).

Ranks are processes started with torch.multiprocessing (NCCL for tensors, gloo for the batch messages,
NVLink multicast off). Rank 0 also computes the TP=1 references on its GPU. Speed is measured by
bench.tp_layer (the tree against NCCL all_reduce per layer), not here.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import rollout_bits, same_bits

pytestmark = pytest.mark.gpu

MODEL_KW = dict(vocab_size=1000, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=4,
                intermediate_size=1024)
SHAPES = {"tiny-qwen2": ("qwen2", MODEL_KW),
          "llama8b-2layers": ("llama", dict(vocab_size=128256, hidden_size=4096, num_layers=2, num_heads=32,
                                            num_kv_heads=8, intermediate_size=14336))}
ENGINE_KW = dict(window=8, group=8, kv_cache_tokens=8192, verified_decode="dvr")
SEQS = [[random.Random(i).randrange(1000) for _ in range(n)] for i, n in enumerate((37, 100, 5, 64))]
PROMPTS = [[random.Random(10 + i).randrange(1000) for _ in range(n)] for i, n in enumerate((5, 23, 40))]
PARAMS = [dict(max_tokens=24, temperature=t, seed=s, determinism=m)
          for m in ("verified", "invariant") for t, s in ((0.0, None), (0.7, 11))]
LAYER = (600, 4096, 512)  # M, K, N of the row-parallel layer check
LAYER_ROWS = (1, 64, 600)  # row counts that pick different kernel configurations
GRAPH_ROWS, GRAPH_STARTS = 64, (0, 200, 536)  # the captured layer's rows, and where its replays read them


def _requests():
    from rollout_service import SamplingParams
    params = [SamplingParams(**p) for p in PARAMS]
    return [p for p in PROMPTS for _ in params], params * len(PROMPTS)


def _verifier_logits(model, ops, device):
    from kernels.forward import model_spec
    from rollout_service.engine.kv_cache import KVCache
    from rollout_service.engine.runner import Chunk, ModelRunner
    cache = KVCache(model_spec(model), 64, 16, device)
    chunks, start = [], 0
    for s in SEQS:
        n = -(-len(s) // 16)
        chunks.append(Chunk(s, 0, list(range(start, start + n)), len(s)))
        start += n
    return [t.cpu() for t in ModelRunner(model, cache, ops, device).forward(chunks)]


def _references(model, device) -> dict:
    """TP=1 on this GPU: engine rollouts, verifier logits, the trainer's log-probs, the layer."""
    import kernels as K
    import trainer_patch
    from kernels.forward import CANONICAL_OPS
    from rollout_service import Engine
    ref = {}
    engine = Engine(model, device=device, **ENGINE_KW)
    ref["rollouts"] = engine.generate(*_requests())
    del engine
    ref["logits"] = _verifier_logits(model.to(device), CANONICAL_OPS, device)
    train = copy.deepcopy(model).to(device)
    ref["train_seq"] = [trainer_patch.token_logprobs(train, torch.tensor([s], device=device))[0].cpu()
                        for s in SEQS]
    ref["train_rollouts"] = []
    prompts, params = _requests()
    for prompt, p, r in zip(prompts, params, ref["rollouts"]):
        ids = torch.tensor([prompt + r.token_ids], device=device)
        lp = trainer_patch.token_logprobs(train, ids, temperature=p.temperature or 1.0)[0, len(prompt) - 1:]
        ref["train_rollouts"].append(lp.cpu())
    x, w, b = _layer_inputs(device)
    ref["layer"] = {m: K.matmul(x[:m], w, b, row_parallel=True).cpu() for m in LAYER_ROWS}
    ref["layer_fp32"] = {m: K.matmul(x[:m], w, row_parallel=True, out_dtype=torch.float32).cpu()
                         for m in LAYER_ROWS}
    return ref


def _layer_inputs(device):
    g = torch.Generator().manual_seed(0)
    m, k, n = LAYER
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    return x.to(device), w.to(device), b.to(device)


def _peer_tree_layer(ctx, device, xl, wl, b) -> dict:
    """The layer through the peer-to-peer tree (reduce="tree_p2p"): both schedules, eager at every
    LAYER_ROWS; then captured in a CUDA graph and replayed on other rows, once with buffers that fit and
    once with buffers too small, where the captured call takes the all-gather path instead."""
    from kernels.symm_tree import SCHEDULES, SymmetricTree
    from kernels.tp import collectives, row_parallel_matmul
    comm = collectives(ctx.group)
    out = {}
    for schedule in SCHEDULES:
        c = dataclasses.replace(comm, peer_tree=SymmetricTree(ctx.group, device, schedule=schedule))
        out[f"layer_p2p_{schedule}"] = {m: row_parallel_matmul(xl[:m], wl, b, c, reduce="tree_p2p").cpu()
                                        for m in LAYER_ROWS}
        out[f"layer_p2p_{schedule}_fp32"] = {
            m: row_parallel_matmul(xl[:m], wl, None, c, reduce="tree_p2p", out_dtype=torch.float32).cpu()
            for m in LAYER_ROWS}
    for name, capacity in (("fits", GRAPH_ROWS * wl.shape[0]), ("too_small", 16 * wl.shape[0])):
        c = dataclasses.replace(comm, peer_tree=SymmetricTree(ctx.group, device, capacity=capacity))
        static_x = xl[:GRAPH_ROWS].clone()
        # outside capture: compiles the kernels (a too-small buffer would grow here, so warm the fallback)
        row_parallel_matmul(static_x, wl, b, c, reduce="tree_p2p" if name == "fits" else "tree")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = row_parallel_matmul(static_x, wl, b, c, reduce="tree_p2p")
        replays = {}
        for start in GRAPH_STARTS:
            static_x.copy_(xl[start:start + GRAPH_ROWS])
            graph.replay()
            replays[start] = static_out.cpu()
        out[f"layer_p2p_graph_{name}"] = replays
        del graph
    return out


def _worker(rank, k, port, path, device_type="cuda", model_kw=None, arch="qwen2"):
    """One rank. device_type="cpu" runs the same steps with gloo (a development check of this file)."""
    import kernels as K
    from kernels.forward import CANONICAL_OPS
    from kernels.reference import exact_math as em
    from kernels.tp import row_parallel_matmul, shard_model, tp_ops
    from rollout_service.tiny_models import tiny_model
    from rollout_service.engine.tp import TPEngine, TPFollower, init_tp_group

    if device_type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    ctx = init_tp_group(rank, k, port, "nccl" if device_type == "cuda" else "gloo")
    model = tiny_model(arch, seed=3, **(model_kw or MODEL_KW))  # seeded CPU init: same on every rank
    vocab = model.config.vocab_size
    out = {}
    if rank == 0:
        out["ref"] = _references(copy.deepcopy(model), device)

    # the row-parallel layer: exact tree, and the plain all_reduce of the ranks' fp32 subtree nodes
    x, w, b = _layer_inputs(device)
    cols = slice(rank * x.shape[1] // k, (rank + 1) * x.shape[1] // k)
    wl = w[:, cols].contiguous()
    for key in ("layer_tree", "layer_tree_fp32", "layer_tree_scatter", "layer_tree_scatter_fp32",
                "layer_all_reduce_fp32", "node_is_subtree"):
        out[key] = {}
    for m in LAYER_ROWS:
        xl = x[:m, cols].contiguous()
        out["layer_tree"][m] = row_parallel_matmul(xl, wl, b, ctx.group).cpu()
        out["layer_tree_fp32"][m] = row_parallel_matmul(xl, wl, None, ctx.group, out_dtype=torch.float32).cpu()
        out["layer_tree_scatter"][m] = row_parallel_matmul(xl, wl, b, ctx.group, reduce="tree_scatter").cpu()
        out["layer_tree_scatter_fp32"][m] = row_parallel_matmul(xl, wl, None, ctx.group, reduce="tree_scatter",
                                                                out_dtype=torch.float32).cpu()
        out["layer_all_reduce_fp32"][m] = row_parallel_matmul(xl, wl, None, ctx.group, reduce="all_reduce",
                                                              out_dtype=torch.float32).cpu()
        # the fused kernel's node for this rank's segments == the tree over its unfused segment partials
        segs = K.tree_segments() // k
        node = K.backend_for(xl).matmul(xl, wl, None, segments=segs, out_dtype=torch.float32)
        parts = list(K.backend_for(xl).matmul_partials(xl, wl, segs).unbind(0))
        out["node_is_subtree"][m] = all(ctx.all_gather_object(same_bits(node, em.tree_combine(parts))))
    if device_type == "cuda":
        out.update(_peer_tree_layer(ctx, device, x[:, cols].contiguous(), wl, b))

    # verifier forward on the shard: tree (exact) and bf16 all_reduce (what ordinary TP engines do)
    local = shard_model(model, rank, k).to(device)
    out["logits_tree"] = _verifier_logits(local, tp_ops(CANONICAL_OPS, ctx.group, vocab_size=vocab), device)
    out["logits_bf16_all_reduce"] = _verifier_logits(local, tp_ops(
        CANONICAL_OPS, ctx.group, vocab_size=vocab, reduce="all_reduce", reduce_dtype=torch.bfloat16), device)
    del local

    # whole rollouts through the TP engine
    if rank == 0:
        engine = TPEngine(model, ctx, device=device, **ENGINE_KW)
        out["rollouts"] = engine.generate(*_requests())
        engine.close()
        torch.save(out, path)
    else:
        TPFollower(model, ctx, device=device, **ENGINE_KW).serve_forever()
    dist.destroy_process_group()


def run_group(k: int, path: str, device_type: str = "cuda", model_kw=None, arch="qwen2") -> dict:
    from rollout_service.engine.tp import free_port
    mp.start_processes(_worker, args=(k, free_port(), path, device_type, model_kw, arch), nprocs=k,
                       start_method="spawn")
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module", params=[(k, shape) for shape in SHAPES for k in (2, 4, 8)],
                ids=lambda p: f"tp{p[0]}-{p[1]}")
def tp(request, tmp_path_factory):
    import kernels as K
    k, shape = request.param
    if not torch.cuda.is_available() or torch.cuda.device_count() < k:
        pytest.skip(f"needs {k} CUDA GPUs")
    pytest.importorskip("kernels.triton")
    assert K.tree_segments() == 8, "these degrees are checked at tree width 8 (ZEROKL_TREE_SEGMENTS)"
    arch, model_kw = SHAPES[shape]
    return k, run_group(k, str(tmp_path_factory.mktemp(f"tp{k}") / "out.pt"), model_kw=model_kw, arch=arch)


@pytest.mark.parametrize("m", LAYER_ROWS)
def test_row_parallel_layer(tp, m):
    k, out = tp
    ref = out["ref"]
    assert out["node_is_subtree"][m], f"TP={k} M={m}: fused subtree node != tree of the rank's segment partials"
    assert same_bits(out["layer_tree"][m], ref["layer"][m]), f"TP={k} M={m}: tree all-reduce != TP=1 matmul"
    assert same_bits(out["layer_tree_fp32"][m], ref["layer_fp32"][m])
    # the tree split by columns over NCCL's all-to-all: the same bits
    assert same_bits(out["layer_tree_scatter"][m], ref["layer"][m])
    assert same_bits(out["layer_tree_scatter_fp32"][m], ref["layer_fp32"][m])
    # no NCCL: one kernel reads the peers' nodes from symmetric memory (both schedules)
    for schedule in ("one_shot", "two_shot"):
        assert same_bits(out[f"layer_p2p_{schedule}"][m], ref["layer"][m]), f"TP={k} M={m}: tree_p2p {schedule}"
        assert same_bits(out[f"layer_p2p_{schedule}_fp32"][m], ref["layer_fp32"][m])
    same = same_bits(out["layer_all_reduce_fp32"][m], ref["layer_fp32"][m])
    print(f"\nTP={k} M={m}: NCCL all_reduce of the fp32 subtree nodes {'equals' if same else 'differs from'} "
          "the tree (at k=2 it is one commutative add)")


def test_row_parallel_layer_peer_tree_in_cuda_graphs(tp):
    """Replays of a captured tree_p2p layer on other rows: the TP=1 rows (the canonical matmul is row
    invariant), with buffers that fit and with the all-gather fallback taken during capture."""
    k, out = tp
    full = out["ref"]["layer"][LAYER[0]]
    for name in ("fits", "too_small"):
        for start, got in out[f"layer_p2p_graph_{name}"].items():
            assert same_bits(got, full[start:start + GRAPH_ROWS]), f"TP={k} {name} replay at row {start}"


def test_verifier_forward_equals_tp1_and_trainer(tp):
    k, out = tp
    ref = out["ref"]
    import kernels as K
    for i, (got, want, seq) in enumerate(zip(out["logits_tree"], ref["logits"], SEQS)):
        assert same_bits(got, want), f"TP={k} sequence {i}: logits differ from TP=1"
        # log-softmax on the GPU, as the trainer's reference was computed there (CPU/GPU kernels differ)
        logp = K.log_softmax(got[:-1].cuda()).gather(1, torch.tensor(seq[1:]).cuda().unsqueeze(1)).squeeze(1).cpu()
        assert same_bits(logp, ref["train_seq"][i]), f"TP={k} sequence {i}: log-probs differ from the trainer"


def test_bf16_all_reduce_negative_control(tp):
    k, out = tp
    differ = [not same_bits(a, b) for a, b in zip(out["logits_bf16_all_reduce"], out["ref"]["logits"])]
    assert any(differ), f"TP={k}: a bf16 all_reduce gave the canonical logits"


def test_rollouts_equal_tp1_and_trainer(tp):
    k, out = tp
    ref = out["ref"]
    assert [rollout_bits(r) for r in out["rollouts"]] == [rollout_bits(r) for r in ref["rollouts"]]
    for j, (r, train) in enumerate(zip(out["rollouts"], ref["train_rollouts"])):
        assert r.ok, r.error
        assert same_bits(torch.tensor(r.logprobs, dtype=torch.float32), train), f"TP={k} request {j}: KL != 0"
