"""bench.vllm_step_profile runs end to end on CPU (a tiny checkpoint through the plugin) and takes
bench.peer_vllm's engine options, so the tool the GPU profiles depend on cannot drift from them unnoticed."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _profile(tmp_path, *options) -> dict:
    """The report of a plugin generate of 2 prompts x 8 tokens, 4 new tokens each, on a tiny checkpoint."""
    pytest.importorskip("vllm")
    from bench.peer.systems import TINY_KW
    from rollout_service.tiny_models import tiny_model
    tiny_model("qwen2", seed=0, **TINY_KW).save_pretrained(tmp_path / "model")
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "bench.vllm_step_profile", "--model", str(tmp_path / "model"),
                           "--system", "vllm-plugin", "--prompts", "2", "--prompt-len", "8", "--max-tokens", "4",
                           *options, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == json.loads(out.read_text())  # stdout is the JSON alone: vLLM logs to stderr
    return json.loads(out.read_text())


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_step_profile_reports_a_plugin_generate(tmp_path):
    report = _profile(tmp_path, "--top", "5", "--num-gpu-blocks", "64")  # (GPU-only; parsed)
    assert report["benchmark"] == "vllm_step_profile" and report["system"] == "vllm-plugin"
    assert report["prompts"] == 2 and report["max_tokens"] == 4 and report["tokens_per_s"] > 0
    # as the speed tables run: every system returns log-probs, in vLLM's flat layout
    assert report["stock_logprobs"] is True and report["logprobs_layout"] == "flat", report


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_step_profile_runs_every_request_through_an_adapter(tmp_path):
    """--lora R: the plugin with vLLM's enable_lora, every request naming a random rank-R adapter."""
    report = _profile(tmp_path, "--lora", "4", "--host-times")
    assert report["lora"] == 4 and report["tokens_per_s"] > 0, report
    assert report["host_per_step"], report


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_step_profile_counts_steps_by_batch_size(tmp_path):
    """--host-times also counts the generate's steps: decode steps by batch size (the rows each product
    sees), and the prefill steps with their tokens. One prefill step of 16 tokens (it samples the first
    token), then 3 decode steps of 2 rows."""
    rows = _profile(tmp_path, "--host-times")["step_rows"]
    assert rows["prefill_steps"] == 1 and rows["prefill_step_tokens"] == rows["prompt_tokens"] == 16, rows
    assert rows["decode_steps"] == 3 and rows["decode_rows"]["1-64"] == 3, rows
    assert sum(rows["decode_rows"].values()) == rows["decode_steps"], rows


def test_host_stalls_count_garbage_collections():
    """--timeline sets the host's pauses against the GPU's idle gaps: each garbage collection inside
    the block is counted by generation, with its start and length."""
    import gc

    from bench.step_profile.timeline import host_stalls
    with host_stalls() as stalls:
        gc.collect()
        gc.collect(0)
    assert stalls["gc"]["gen2"]["count"] == 1 and stalls["gc"]["gen0"]["count"] >= 1, stalls
    assert stalls["longest_gc"][0]["generation"] == 2 and stalls["longest_gc"][0]["ms"] > 0, stalls
    with host_stalls() as quiet:
        pass
    assert quiet["gc"] == {} and quiet["triton_compiles"]["count"] == 0, quiet


def test_largest_gaps_name_the_work_around_them():
    """Each long idle gap names the device work before and after it and the host ops overlapping it,
    longest first (microsecond timestamps, as in torch.profiler's trace)."""
    from bench.step_profile.timeline import idle_gaps, largest_gaps
    events = [dict(cat="kernel", name="k1", ts=0, dur=10), dict(cat="kernel", name="k2", ts=100, dur=10),
              dict(cat="gpu_memcpy", name="copy", ts=115, dur=5), dict(cat="kernel", name="k3", ts=500, dur=5),
              dict(cat="cpu_op", name="aten::slow", ts=20, dur=300),
              dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=490, dur=5)]
    gaps = idle_gaps([(e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] != "cpu_op"
                       and e["cat"] != "cuda_runtime"], min_us=20)
    assert gaps == [(10, 100), (120, 500)]
    longest, second = largest_gaps(events, gaps, first=0, top=5)
    assert (longest["us"], longest["before"], longest["after"]) == (380, "copy", "k3")
    assert longest["host"] == [dict(op="cpu_op: aten::slow", us=200), dict(op="cuda_runtime: cudaLaunchKernel", us=5)]
    assert (second["us"], second["before"], second["after"]) == (90, "k1", "k2")
    assert second["host"] == [dict(op="cpu_op: aten::slow", us=80)]
