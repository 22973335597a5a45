"""bench.switch_cost runs end to end on CPU (the tiny model) and prints its JSON: per generated length,
the decode step, the switch step (its load apart) and their paired ratios, round by round."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_switch_cost_cpu_smoke():
    proc = subprocess.run([sys.executable, "-m", "bench.switch_cost", "--model", "tiny", "--device", "cpu",
                           "--batch", "4", "--prompt", "16", "--generated", "8,24", "--rounds", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["device"] == "cpu" and [r["generated"] for r in out["results"]] == [8, 24]
    for r in out["results"]:
        assert r["recomputed_tokens"] == 4 * (16 + r["generated"])
        assert r["decode_step_s"] > 0 and r["switch_step_s"] > r["of_which_load_s"] > 0 and len(r["pairs"]) == 2
