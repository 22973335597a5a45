"""recipes.gpu_clocks: a train step's GPU clock, power and temperature from nvidia-smi's own sampling loop.
Here a stand-in nvidia-smi on PATH prints samples as the real one does (csv, noheader, nounits), some with a
field the GPU does not report; where there is no nvidia-smi or no GPU there are no figures and no error."""
import os
import stat
import statistics
import sys
import time

import pytest

from recipes.gpu_clocks import ClockSampler
from recipes.metrics import train_device_metrics

FAKE_SMI = """#!{python}
import sys, time
open({args!r}, "w").write(" ".join(sys.argv[1:]))
rows = ["1755, 612.50, 71", "[N/A], 600.00, 70", "1980, 650.25, 73", "1410, 700.00, 75"]
i = 0
while True:
    print(rows[i % len(rows)], flush=True)
    i += 1
    time.sleep(0.01)
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    args = tmp_path / "args.txt"
    smi.write_text(FAKE_SMI.format(python=sys.executable, args=str(args)))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return args


def test_samples_one_gpu_while_the_block_runs(fake_smi):
    with ClockSampler("GPU-1234", interval_ms=10) as clocks:
        deadline = time.monotonic() + 5
        while not fake_smi.exists() or len(fake_smi.read_text()) == 0:  # the sampler has started
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
    assert "--id=GPU-1234" in fake_smi.read_text() and "--loop-ms=10" in fake_smi.read_text()
    got = clocks.summary()
    assert got["samples"] == len(clocks.samples) >= 6
    assert {s[0] for s in clocks.samples} == {1755, 1980, 1410}  # the [N/A] rows are left out
    assert got["sm_clock_mhz"] == statistics.median(s[0] for s in clocks.samples)
    assert got["sm_clock_mhz_min"] == 1410 and got["temperature_c_max"] == 75
    assert got["power_w"] == statistics.median(s[1] for s in clocks.samples)


def test_no_gpu_or_no_nvidia_smi_gives_no_figures(tmp_path, monkeypatch):
    with ClockSampler(None) as clocks:  # a CPU device
        pass
    assert clocks.summary() == {}
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    with ClockSampler("GPU-1234") as clocks:
        pass
    assert clocks.summary() == {}


def test_the_step_metrics_take_the_slowest_rank_clock():
    rank = {"peak_memory_bytes": 2 ** 30, "tokens": 1000, "num_params": 10 ** 9}
    ranks = [{**rank, "gpu_clocks": dict(sm_clock_mhz=1980, sm_clock_mhz_min=1900, power_w=640, temperature_c_max=70)},
             {**rank, "gpu_clocks": dict(sm_clock_mhz=1755, sm_clock_mhz_min=1410, power_w=700, temperature_c_max=81)}]
    got = train_device_metrics(ranks, 2.0)
    assert (got["perf/train_sm_clock_mhz"], got["perf/train_sm_clock_mhz_min"]) == (1755, 1410)
    assert (got["perf/train_gpu_power_w"], got["perf/train_gpu_temperature_c"]) == (700, 81)
    assert "perf/train_sm_clock_mhz" not in train_device_metrics([{**rank, "gpu_clocks": {}}], 2.0)
