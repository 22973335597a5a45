"""Weight pushes to a rollout pool, by transport, against the copy limit of the link they use; prints JSON.

    python -m bench.weight_sync --model qwen1.5b --transports object_store,ipc          # one GPU, colocated
    python -m bench.weight_sync --model qwen1.5b --transports object_store,broadcast --separate-gpus
    python -m bench.weight_sync --model qwen1.5b --transports ipc,ipc:streamed --backend vllm
    python -m bench.weight_sync --model llama8b --transports object_store,ipc --lora 16   # adapter-only pushes

An arm is a transport, staged (the whole push in one buffer on the sender: weight_sync's rule) or,
with ":streamed", bucket by bucket (stage_bytes=0). The pool has one worker on a GPU, native or vLLM
(--backend; sharing the sender's GPU, or on a GPU of its own with --separate-gpus); the sender is this process, holding a bf16 state dict on its GPU, as a trainer
rank does after gathering. Transports take turns push by push (machines are noisy), each push's
digest is checked, and every figure is measured in this run: seconds per push (median), GB/s, and
the copy limit (a device-to-device copy of the same bytes on the same link). The sender's check pass
(finite values and fingerprints) is timed on its own as well. With --lora R each push is a LoRA adapter of
rank R on every projection (RolloutClient.load_adapter: the adapter's bytes alone, random values).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPES = {  # transformers configs with each model's real vocabulary; random weights
    "qwen1.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                     num_kv_heads=2, intermediate_size=8960),
    "llama8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                    num_kv_heads=8, intermediate_size=14336),
    "llama8b-8l": dict(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=8, num_heads=32,
                       num_kv_heads=8, intermediate_size=14336),
    "tiny": dict(arch="qwen2"),
}


def build(shape: str, seed: int, device: str) -> torch.nn.Module:
    """Random weights, initialised on `device` (a 1.5B model takes a minute on a CPU, a second on a GPU)."""
    from rollout_service.tiny_models import tiny_model
    opts = dict(SHAPES[shape])
    arch = opts.pop("arch")
    with torch.device(device):
        return tiny_model(arch, seed=seed, **opts)


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    """A timestamped line on stderr (stdout carries only the JSON)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def random_adapter(model: torch.nn.Module, r: int):
    """A LoRA adapter of rank r on every dense projection of `model`, random bf16 values (B too: a trained one)."""
    from rollout_service.lora import PROJECTIONS, LoraAdapter, projection_shapes
    tensors, gen = {}, torch.Generator().manual_seed(r)
    for (layer, name), (out, inp) in projection_shapes(model).items():
        block = next(b for b, names in PROJECTIONS.items() if name in names)
        key = f"model.layers.{layer}.{block}.{name}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(r, inp, generator=gen) * inp ** -0.5).to(torch.bfloat16)
        tensors[f"{key}.lora_B.weight"] = (torch.randn(out, r, generator=gen) * 0.01).to(torch.bfloat16)
    targets = tuple(sorted(n for names in PROJECTIONS.values() for n in names))
    return LoraAdapter(r, 2.0 * r, targets, tensors)


def _sync(*devices: torch.device) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def copy_limit_s(nbytes: int, src: torch.device, dst: torch.device, repeats: int = 5) -> float:
    """Seconds for one copy of `nbytes` from src to dst (the link's limit; a memcpy on the host)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    times = []
    for _ in range(repeats):
        _sync(src, dst)
        t = time.perf_counter()
        b.copy_(a)
        _sync(src, dst)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="qwen1.5b")
    ap.add_argument("--transports", default="object_store,ipc")
    ap.add_argument("--separate-gpus", action="store_true", help="the worker on a GPU of its own")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--backend", choices=["native", "vllm"], default="native", help="the worker's engine")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (gloo, host copies)")
    ap.add_argument("--lora", type=int, default=0, help="push a LoRA adapter of this rank instead of the weights")
    args = ap.parse_args()

    import ray

    from rollout_service import start_pool
    from rollout_service.service.weight_sync import DEFAULT_STAGE_BYTES, fingerprint_entries
    from rollout_service.lora import LoraAdapter, push_digest
    from rollout_service.weights import state_dict_digest

    transports = args.transports.split(",")
    start_model, pushed = build(args.model, 0, args.device).cpu(), build(args.model, 1, args.device)
    model_bytes = nbytes = sum(t.numel() * 2 for t in pushed.state_dict().values())
    adapter = random_adapter(start_model, args.lora) if args.lora else None
    if adapter is not None:
        nbytes = adapter.nbytes
    progress(f"models built ({model_bytes / 1e9:.2f} GB of bf16; a push carries {nbytes / 1e6:.1f} MB)")
    ray.init(include_dashboard=False, log_to_driver=False)
    on_gpu = args.device == "cuda"
    resources = {"num_cpus": 1, "num_gpus": (1 if args.separate_gpus else 0.5)} if on_gpu else {"num_cpus": 1}
    engine = {"native": {"kv_cache_tokens": 4096, "cuda_graphs": False},  # pushes only: nothing to capture
              "vllm": {"gpu_memory_utilization": 0.3} if on_gpu else {}}[args.backend]
    pool = start_pool(start_model, num_workers=1, name="bench-weight-sync",
                      engine_kwargs={"device": args.device, "backend": args.backend, **engine},
                      resources_per_worker=resources, start_timeout_s=600)
    progress("pool started")
    try:
        sender = receiver = torch.device("cpu")
        if on_gpu:  # the sender on the worker's GPU, or on another one
            worker_gpu = pool.stats()["workers"][0]["gpu"]
            uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
            sender = torch.device("cuda", [i for i, u in enumerate(uuids) if (u != worker_gpu) == args.separate_gpus][0])
            receiver = torch.device("cuda", uuids.index(worker_gpu))
            torch.cuda.set_device(sender)
        source = pushed.state_dict() if adapter is None else adapter.tensors
        on_device = {k: v.detach().to(sender, torch.bfloat16) for k, v in source.items()}
        on_host = {k: v.detach().to("cpu", torch.bfloat16) for k, v in source.items()}
        digests = {"pushed": state_dict_digest(on_device)}
        if adapter is not None:  # what load_adapter returns: the digest of adapter and base
            digests["pushed"] = push_digest(digests["pushed"], pool.weights_digest())
        del start_model, pushed

        t = time.perf_counter()
        fingerprint_entries(on_device.items())
        _sync(sender)
        check_s = time.perf_counter() - t

        seconds = {tr: [] for tr in transports}
        for r in range(args.repeats + 1):  # round 0 warms up; every push rewrites all the weights
            for tr in transports:
                transport, _, how = tr.partition(":")
                sd = on_device if transport != "object_store" else on_host  # object_store: as the trainer had it
                stage = {"": DEFAULT_STAGE_BYTES, "streamed": 0}[how]
                sizes = dict(transport=transport, bucket_bytes=args.bucket_mb << 20, stage_bytes=stage)
                t = time.perf_counter()
                if adapter is None:
                    got = pool.update_weights(sd, **sizes)
                else:
                    got = pool.load_adapter("bench", LoraAdapter.from_settings(adapter.settings(), sd), **sizes)
                dt = time.perf_counter() - t
                progress(f"round {r} {tr}: {dt:.3f}s")
                assert got == digests["pushed"], (tr, got)
                if r:
                    seconds[tr].append(dt)
        limit = copy_limit_s(nbytes, sender, receiver)
        out = {"model": args.model, "bytes": nbytes, "model_bytes": model_bytes, "lora_rank": args.lora,
               "separate_gpus": args.separate_gpus,
               "bucket_mb": args.bucket_mb, "backend": args.backend,
               "device": torch.cuda.get_device_name(sender) if on_gpu else "cpu",
               "sender_check_s": round(check_s, 4), "copy_limit_s": float(f"{limit:.4g}"),
               "copy_limit_gb_s": round(nbytes / limit / 1e9, 1), "transports": {}}
        for tr, times in seconds.items():
            med = statistics.median(times)
            out["transports"][tr] = {"seconds": [round(x, 4) for x in times], "median_s": round(med, 4),
                                     "gb_s": round(nbytes / med / 1e9, 2)}
        for tr in transports:  # push by push, the streamed form against the staged one of the same round
            if tr + ":streamed" in seconds:
                ratios = [a / b for a, b in zip(seconds[tr + ":streamed"], seconds[tr])]
                out["transports"][tr]["streamed_over_staged"] = {
                    "per_round": [round(x, 3) for x in ratios], "median": round(statistics.median(ratios), 3)}
        print(json.dumps(out))
    finally:
        pool.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
