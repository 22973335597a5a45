"""bench.grpo_step runs both arms of the tiny recipe on CPU, in turn, and prints its JSON: the zero-KL
arm's KL and max |Δ| are exactly 0, the stock arm's are not, and every step part has its median."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[1]


def test_bench_grpo_step_cpu_smoke(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": "local", "HOME": str(tmp_path)}  # runs land in tmp_path/zerokl-runs
    proc = subprocess.run([sys.executable, "-m", "bench.grpo_step", "--device", "cpu", "--steps", "2",
                           "--rounds", "1", "trainer.weight_sync=broadcast"],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    [row] = out["rounds"]
    canonical, stock = row["canonical"], row["stock"]
    assert canonical["max_kl"] == 0.0 and canonical["max_abs_logprob_diff"] == 0.0
    assert stock["max_abs_logprob_diff"] > 0.0
    for arm in (canonical, stock):
        assert arm["steps"] == 2 and arm["step_s"] > 0 and arm["rollout_s"] > 0 and arm["train_s"] > 0
        assert set(arm["sync_phases_s"]) == {"connect", "check", "begin", "send", "finish"}
        assert sum(arm["sync_phases_s"].values()) <= arm["weight_sync_s"] * 1.0001
    assert row["stock_over_canonical_step"] == stock["step_s"] / canonical["step_s"]
