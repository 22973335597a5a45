"""bench.multinode_pool at its smallest (one worker a pool, one node): its JSON, with no request lost or run
twice, and the pool back at full capacity on a spare node after each node loss."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a 4-node cluster and two pools: ~60 s on 2 cores
def test_bench_multinode_pool_smoke():
    proc = subprocess.run([sys.executable, "-m", "bench.multinode_pool", "--workers", "1", "--nodes", "1",
                           "--requests", "8", "--rounds", "1", "--loss-requests", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["placement"] == {"one_node": ["one_node"], "spread": ["spread0"]}
    assert out["median_req_s"]["one_node"] > 0 and out["spread_over_one_node"] > 0
    assert out["lost"] == out["duplicated"] == 0
    for loss in (out["node_loss_idle"], out["node_loss_under_load"]):
        assert loss["recovery_s"] > 0 and loss["worker_back_on"].startswith("spare"), loss
    loaded = out["node_loss_under_load"]
    assert loaded["completed"] == loaded["worker_executions"] == 4 and loaded["lost"] == loaded["duplicated"] == 0
