"""bench.weight_sync runs end to end on CPU (the tiny model, object store and gloo broadcast) and prints
its JSON: per-arm seconds and GB/s next to the copy limit, and the streamed / staged ratio per round."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_bench_weight_sync_cpu_smoke():
    env = {**os.environ, "RAY_ADDRESS": "local"}
    proc = subprocess.run([sys.executable, "-m", "bench.weight_sync", "--model", "tiny", "--device", "cpu",
                           "--transports", "object_store,broadcast,broadcast:streamed", "--repeats", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["bytes"] > 0 and out["copy_limit_s"] > 0
    for transport in ("object_store", "broadcast", "broadcast:streamed"):
        t = out["transports"][transport]
        assert len(t["seconds"]) == 1 and t["median_s"] > 0 and t["gb_s"] >= 0
    ratio = out["transports"]["broadcast"]["streamed_over_staged"]
    assert len(ratio["per_round"]) == 1 and ratio["median"] > 0


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_bench_weight_sync_lora_pushes_the_adapters_bytes_alone():
    pytest.importorskip("peft")
    env = {**os.environ, "RAY_ADDRESS": "local"}
    proc = subprocess.run([sys.executable, "-m", "bench.weight_sync", "--model", "tiny", "--device", "cpu",
                           "--transports", "object_store,broadcast", "--repeats", "1", "--lora", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # r = 4 on the 7 projections of 2 layers (hidden 64, kv 32, intermediate 128), bf16
    per_layer = 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))
    assert out["lora_rank"] == 4 and out["bytes"] == 2 * 2 * per_layer < out["model_bytes"]
    assert all(len(t["seconds"]) == 1 for t in out["transports"].values())
