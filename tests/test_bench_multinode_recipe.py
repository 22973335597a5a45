"""bench.multinode_recipe runs both arms on its CPU test cluster and prints its JSON: the arms' actors on one
node and on three, KL and max |Δ log-prob| 0.0, positive step times and their ratio."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # two recipe runs on a cluster of four raylets
def test_bench_multinode_recipe_cpu_smoke():
    env = {**os.environ, "HOME": tempfile.mkdtemp()}  # Ray's auth token and wandb write under HOME
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "bench.multinode_recipe", "--steps", "2", "--rounds", "1",
                           "warmup.steps=0", "train.prompts_per_step=4"],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    [round_] = out["rounds"]
    assert round_["1 node"]["nodes"] == {"workers": ["a", "a"], "ranks": ["a", "a"]}
    assert sorted(round_["3 nodes"]["nodes"]["workers"]) == ["a", "b"]  # one worker each, in either slot
    assert round_["3 nodes"]["nodes"]["ranks"] == ["c", "c"]
    assert (round_["1 node"]["distinct_nodes"], round_["3 nodes"]["distinct_nodes"]) == (1, 3)
    for arm in ("1 node", "3 nodes"):
        assert round_[arm]["max_kl"] == 0.0 and round_[arm]["max_abs_logprob_diff"] == 0.0
        assert all(round_[arm][k] > 0 for k in ("step_s", "rollout_s", "train_s", "weight_sync_s"))
    assert out["median_step_ratio_3_over_1"] == round_["step_ratio_3_over_1"] > 0
