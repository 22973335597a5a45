"""bench.tp_layer on CPU (gloo, two rank processes): the report has, per row count, the tree's (both
ways: all-gathered, and split by columns) and the all-reduce's collective and layer times and their
ratios (the GPU run compares them over NCCL), and the ratios are plotted."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_tree_against_all_reduce_at_tp2(tmp_path):
    out = tmp_path / "tp_layer.json"
    proc = subprocess.run([sys.executable, "-m", "bench.tp_layer", "--degrees", "2", "--rows", "1,3", "--iters", "2",
                           "--out", str(out), "--plot", str(tmp_path / "tp.png")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu (gloo)" and list(report["degrees"]) == ["2"]
    rows = report["degrees"]["2"]
    assert [r["rows"] for r in rows] == [1, 3]
    for r in rows:
        times = {k: v for k, v in r.items() if k.endswith("_us")}
        assert len(times) == 9 and all(v > 0 for v in times.values()), r
        for tree in ("", "scatter_"):  # the tree all-gathered, and split by columns (reduce="tree_scatter")
            collective = "tree_collective_us" if not tree else "scatter_collective_us"
            assert r[f"{tree}collective_ratio"] == round(r[collective] / r["all_reduce_collective_us"], 3)
            for layer in ("o_proj", "down_proj"):
                layer_us = r[f"{layer}_{tree or 'tree_'}layer_us"]
                assert r[f"{layer}_{tree}layer_ratio"] == round(layer_us / r[f"{layer}_stock_layer_us"], 3)
    assert (tmp_path / "tp.png").read_bytes()[:8] == PNG


def test_plots_the_committed_gpu_report(tmp_path):
    """The committed multi-GPU run (degrees it could not run are skipped in the plot)."""
    from bench.tp_layer import plot
    reports = sorted((ROOT / "bench" / "results").glob("*/tp_layer.json"))
    assert reports, "no committed tp_layer report"
    report = json.loads(reports[-1].read_text())
    assert report["benchmark"] == "tp_layer" and report["gpus"] >= 2
    assert (Path(plot(report, str(tmp_path / "gpu.png")))).read_bytes()[:8] == PNG
