"""bench.grpo_train_step runs both arms of the recipe's train step on CPU (the tiny shape) and prints its
JSON: per arm and round the step's seconds, the stock / canonical ratio, and a profiled step's tables."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_grpo_train_step_cpu_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.grpo_train_step", "--model", "tiny", "--device", "cpu",
                           "--prompts", "4", "--group", "2", "--warmup", "1", "--steps", "2",
                           "--profile", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    (row,) = out["rounds"]
    for arm in ("canonical", "stock"):
        assert len(row[arm]["seconds"]) == 2 and row[arm]["median_s"] > 0
        assert row[arm]["host_self_s"] > 0 and row[arm]["profiled_step_s"] > 0
        assert "aten::" in (tmp_path / f"train_step_{arm}.txt").read_text()
    assert row["stock_over_canonical"] == row["stock"]["median_s"] / row["canonical"]["median_s"]
    assert out["stock_over_canonical_median"] == row["stock_over_canonical"]
