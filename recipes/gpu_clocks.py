"""The GPU's SM clock, power draw and temperature while a phase runs, sampled by nvidia-smi's own loop.

A trainer step that runs slower inside a colocated GRPO step than on its own may be slower work or a slower
GPU: the rollout before it can leave the card hot or at its power limit, and the driver then lowers the
clocks. These figures tell the two apart. Sampling is a separate nvidia-smi process, so it costs the step
nothing; where there is no nvidia-smi (CPU runs) or no CUDA device, there are no figures.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

import torch

from rollout_service.service.weight_sync.plan import gpu_uuid

QUERY = "clocks.sm,power.draw,temperature.gpu"


def gpu_id(device: torch.device) -> str | None:
    """nvidia-smi's --id for a CUDA device: "GPU-" and its UUID (torch gives the UUID bare), not an index,
    because nvidia-smi's indices ignore CUDA_VISIBLE_DEVICES."""
    return f"GPU-{gpu_uuid(device)}" if device.type == "cuda" else None


class ClockSampler:
    """`with ClockSampler(gpu): ...` samples that GPU every `interval_ms` until the block ends; then
    summary() holds the median and lowest SM clock (MHz), the median power draw (W) and the highest
    temperature (°C) of the samples. gpu None: no sampling, an empty summary."""

    def __init__(self, gpu: str | None, interval_ms: int = 100):
        self.gpu, self.interval_ms = gpu, interval_ms
        self._proc: subprocess.Popen | None = None
        self._out = None  # nvidia-smi's output goes to a file: a pipe nobody reads fills in minutes and stalls it
        self.samples: list[tuple[float, float, float]] = []

    def __enter__(self) -> "ClockSampler":
        smi = shutil.which("nvidia-smi")
        if self.gpu is not None and smi is not None:
            self._out = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                [smi, f"--id={self.gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 f"--loop-ms={self.interval_ms}"], stdout=self._out, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait()
        self._proc = None
        with self._out:
            self._out.seek(0)
            self.samples = [row for row in map(_parse, self._out.read().splitlines()) if row is not None]
        self._out = None

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks, power, temperature = zip(*self.samples)
        return {"sm_clock_mhz": statistics.median(clocks), "sm_clock_mhz_min": min(clocks),
                "power_w": statistics.median(power), "temperature_c_max": max(temperature),
                "samples": len(self.samples)}


def _parse(line: str) -> tuple[float, float, float] | None:
    """One sample line ("1980, 652.31, 61"); None for a line with a field the GPU does not report ([N/A])."""
    try:
        clock, power, temperature = (float(field) for field in line.split(","))
    except ValueError:
        return None
    return clock, power, temperature
