"""bench.node_loss runs on Ray's multi-node test cluster on CPU and prints its JSON: a run that loses a rollout
node while step 2's requests are in flight, its step times, the requests run again and the replacement's start."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # a multi-node cluster and a recipe run


def test_bench_node_loss_cpu_smoke():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster, not a joined one
    env["HOME"] = tempfile.mkdtemp()
    proc = subprocess.run([sys.executable, "-m", "bench.node_loss", "--steps", "2", "--lose-at", "2",
                           "--prompts", "8", "--no-reference"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["steps"] == 2 and out["lose_at"] == 2 and out["requests_per_step"] == 64
    assert out["lost_node"].startswith("rollout") and 0 < out["requests_in_flight_at_loss"] <= 64
    assert len(out["step_s"]) == 2 and out["lost_step_s"] == out["step_s"][1] > 0
    assert out["median_step_s_before"] == out["step_s"][0] > 0
    assert 0 < out["death_seen_s"] < out["replacement_serving_s"] and out["kl_zero_every_step"] is True
    assert "reference_step_s" not in out  # --no-reference
