"""bench.ray_round_trip runs on CPU and prints its JSON: every figure a positive median in ms."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_ray_round_trip_cpu_smoke():
    proc = subprocess.run([sys.executable, "-m", "bench.ray_round_trip", "--calls", "5"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    callers = ("driver->async actor", "sync actor->async actor", "async actor->async actor")
    want = {f"{c} {size}B ms" for c in callers for size in (0, 33_000)} | {"driver->actor returning a handle ms"}
    want |= {f"driver->async actor, a push plan as {form} ms" for form in ("an object", "its wire form")}
    assert set(out) == want and all(v > 0 for v in out.values())
