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
