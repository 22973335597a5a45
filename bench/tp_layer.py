"""The per-layer cost of the row-parallel segment tree against the stock all-reduce, at each TP degree.

    python -m bench.tp_layer [--degrees 2,4,8] [--rows 1,16,64,256,1024,4096] [--out FILE] [--plot PNG]
    python -m bench.tp_layer --plot PNG --from FILE   # plot a saved report

One process per rank (NCCL on GPUs, NVLink multicast off; gloo on CPU for a development run), the
row-parallel layers of Llama-3.1-8B (o_proj: K = 4096, down_proj: K = 14336, N = 4096; each rank holds
K/k), M token rows. Per row count, median microseconds of:
- `tree_collective`: all-gather of the ranks' fp32 [M, 4096] subtree nodes + the tree's top levels;
- `scatter_collective`: the same adds split by columns (reduce="tree_scatter": all-to-all of fp32
  column slices, the tree's top levels on this rank's slice, all-gather of the bf16 slices);
- `all_reduce_collective`: NCCL all_reduce of one bf16 [M, 4096] tensor (what stock vLLM sums);
- `tree_layer` / `scatter_layer`: the whole deterministic layer (canonical matmul of the rank's K
  slice, then either reduction);
- `stock_layer`: cuBLAS matmul of the same slice to bf16, then NCCL all_reduce.
- `p2p_collective` / `p2p_layer`: the same adds with no NCCL (reduce="tree_p2p": one kernel reads the
  peers' nodes from symmetric memory over NVLink, combines, adds the bias and rounds; GPUs only);
- `p2p_all_reduce_collective`: torch's symmetric-memory one-shot all-reduce of the bf16 tensor (a
  peer-to-peer sum in the library's order, like vLLM's custom all-reduce; GPUs only).
On GPUs each figure is one call inside a CUDA graph (REPS calls captured, replayed, timed with CUDA
events), as a decode step runs them; on CPU, eager calls. Degrees above the number of GPUs are reported
as not run. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import emit

HIDDEN = 4096
LAYERS = {"o_proj": 4096, "down_proj": 14336}  # K of Llama-3.1-8B's row-parallel linears


REPS = 20  # calls per captured graph


def _graph_us(fn, iters: int) -> float:
    """Median microseconds per call of `fn` replayed from a CUDA graph of REPS calls, ranks in step."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    del graph
    return statistics.median(times)


def _timed_us(fn, device, iters: int) -> float:
    """Median microseconds per call, every rank in step (a barrier before each call); on GPUs from a
    CUDA graph (_graph_us)."""
    if device.type == "cuda":
        return _graph_us(fn, iters)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _rank(rank: int, k: int, port: int, rows: list[int], iters: int, out_path: str) -> None:
    from kernels.reference import exact_math as em
    from kernels.tp import collectives, gather_ranks, row_parallel_matmul, tree_scatter_combine
    from kernels.symm_tree import SymmetricTree

    cuda = torch.cuda.is_available()
    if cuda:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=k, device_id=device if cuda else None)
    comm = collectives()
    p2p = SymmetricTree(dist.group.WORLD, device, capacity=max(rows) * HIDDEN) if cuda else None
    p2p_comm = dataclasses.replace(comm, peer_tree=p2p)
    g = torch.Generator(device=device).manual_seed(rank)
    results = []
    for m in rows:
        node = torch.randn(m, HIDDEN, device=device, generator=g)
        part = node.bfloat16()
        row = dict(rows=m,
                   tree_collective_us=_timed_us(lambda: em.tree_combine(gather_ranks(node, comm)), device, iters),
                   scatter_collective_us=_timed_us(lambda: tree_scatter_combine(node, None, comm, torch.bfloat16),
                                                   device, iters),
                   all_reduce_collective_us=_timed_us(lambda: dist.all_reduce(part.clone()), device, iters))
        if cuda:
            row["p2p_collective_us"] = _timed_us(lambda: p2p(node, None, torch.bfloat16), device, iters)
            row["p2p_all_reduce_collective_us"] = _p2p_all_reduce_us(part, iters)
        for name, k_full in LAYERS.items():
            x = torch.randn(m, k_full // k, device=device, generator=g).bfloat16()
            w = (torch.randn(HIDDEN, k_full // k, device=device, generator=g) * 0.02).bfloat16()
            row[f"{name}_tree_layer_us"] = _timed_us(lambda: row_parallel_matmul(x, w, None, comm), device, iters)
            row[f"{name}_scatter_layer_us"] = _timed_us(
                lambda: row_parallel_matmul(x, w, None, comm, reduce="tree_scatter"), device, iters)
            row[f"{name}_stock_layer_us"] = _timed_us(lambda: dist.all_reduce(x @ w.T), device, iters)
            if cuda:
                row[f"{name}_p2p_layer_us"] = _timed_us(
                    lambda: row_parallel_matmul(x, w, None, p2p_comm, reduce="tree_p2p"), device, iters)
        for key in [key for key in row if key.endswith("_us") and row[key] is not None]:
            row[key] = round(row[key], 1)
        for prefix in [p for p in ("", "scatter_", "p2p_") if f"{p or 'tree_'}collective_us" in row]:
            row[f"{prefix}collective_ratio"] = round(
                row[f"{prefix or 'tree_'}collective_us"] / row["all_reduce_collective_us"], 3)
            for name in LAYERS:
                row[f"{name}_{prefix}layer_ratio"] = round(
                    row[f"{name}_{prefix or 'tree_'}layer_us"] / row[f"{name}_stock_layer_us"], 3)
        results.append(row)
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def _p2p_all_reduce_us(part: torch.Tensor, iters: int) -> float | None:
    """torch's symmetric-memory one-shot all-reduce of `part` (None where this torch lacks it)."""
    import torch.distributed._symmetric_memory as symm_mem
    op = getattr(torch.ops.symm_mem, "one_shot_all_reduce", None)
    if op is None:
        return None
    try:
        buf = symm_mem.empty(part.numel(), dtype=part.dtype, device=part.device).view(part.shape)
        symm_mem.rendezvous(buf, dist.group.WORLD)
        buf.copy_(part)
        return _graph_us(lambda: op(buf, "sum", dist.group.WORLD.group_name), iters)
    except RuntimeError as exc:  # a figure for comparison only: report it missing, keep the run
        print(f"torch's one-shot all-reduce did not run: {exc}", file=sys.stderr)
        return None


def run_degree(k: int, rows: list[int], iters: int) -> list[dict]:
    from rollout_service.engine.tp import free_port
    with tempfile.TemporaryDirectory(prefix="tp-layer-") as tmp:
        path = os.path.join(tmp, "rows.pt")
        mp.start_processes(_rank, args=(k, free_port(), rows, iters, path), nprocs=k, start_method="spawn")
        return torch.load(path)


def plot(report: dict, out: str) -> str:
    """Per TP degree, the tree's time over the stock one against the row count: the collective and
    each layer (1 = as fast as cuBLAS and NCCL's all-reduce)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    degrees = {k: rows for k, rows in report["degrees"].items() if isinstance(rows, list)}
    fig, axes = plt.subplots(1, max(len(degrees), 1), figsize=(4.5 * max(len(degrees), 1), 3.6), squeeze=False)
    for ax, (k, rows) in zip(axes[0], degrees.items()):
        ms = [r["rows"] for r in rows]
        for prefix, style, what in (("", "-", ""), ("scatter_", "--", ", tree_scatter"), ("p2p_", ":", ", tree_p2p")):
            if f"{prefix}collective_ratio" not in rows[0]:  # reports from before tree_scatter
                continue
            ax.plot(ms, [r[f"{prefix}collective_ratio"] for r in rows], style, marker="o", label=f"collective{what}")
            for name in report["layers"]:
                ax.plot(ms, [r[f"{name}_{prefix}layer_ratio"] for r in rows], style, marker="o",
                        label=f"{name} layer{what}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token rows")
        ax.set_title(f"TP = {k}, {report['device']}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tree / stock time")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--degrees", default="2,4,8")
    p.add_argument("--rows", default="1,16,64,256,1024,4096")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out")
    p.add_argument("--plot", help="also draw the ratios to this PNG")
    p.add_argument("--from", dest="from_file", help="with --plot: draw this saved report, run nothing")
    args = p.parse_args()
    if args.from_file:
        if not args.plot:
            p.error("--from needs --plot")
        with open(args.from_file) as f:
            print(plot(json.load(f), args.plot))
        return
    rows = [int(m) for m in args.rows.split(",")]
    gpus = torch.cuda.device_count()
    report = dict(benchmark="tp_layer", device=torch.cuda.get_device_name() if gpus else "cpu (gloo)", gpus=gpus,
                  hidden=HIDDEN, layers=LAYERS, degrees={})
    from tqdm import tqdm
    for k in tqdm([int(d) for d in args.degrees.split(",")], desc="TP degrees"):
        if gpus and k > gpus:
            report["degrees"][k] = dict(not_run=f"needs {k} GPUs, this machine has {gpus}")
            continue
        report["degrees"][k] = run_degree(k, rows, args.iters)
    emit(report, args.out)
    if args.plot:
        plot(json.loads(json.dumps(report)), args.plot)  # the JSON form: degree keys as strings


if __name__ == "__main__":
    main()
