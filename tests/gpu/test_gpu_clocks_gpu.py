"""recipes.gpu_clocks on a real GPU: nvidia-smi finds the device by the id the sampler gives it (its UUID,
whatever CUDA_VISIBLE_DEVICES says) and reports a clock for the time the GPU works."""
import pytest
import torch

from recipes.gpu_clocks import ClockSampler, gpu_id

pytestmark = pytest.mark.gpu


def test_a_busy_gpu_reports_its_clock_power_and_temperature():
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    with ClockSampler(gpu_id(device), interval_ms=50) as clocks:
        for _ in range(200):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    got = clocks.summary()
    assert got.get("samples", 0) >= 3, got
    assert 100 < got["sm_clock_mhz_min"] <= got["sm_clock_mhz"] < 5000, got
    assert got["power_w"] > 0 and got["temperature_c_max"] > 0, got
