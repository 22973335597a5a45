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
    from bench.peer_vllm import TINY_KW
    from rollout_service.tiny_models import tiny_model
    tiny_model("qwen2", seed=0, **TINY_KW).save_pretrained(tmp_path / "model")
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "bench.vllm_step_profile", "--model", str(tmp_path / "model"),
                           "--system", "vllm-plugin", "--prompts", "2", "--prompt-len", "8", "--max-tokens", "4",
                           *options, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_step_profile_reports_a_plugin_generate(tmp_path):
    report = _profile(tmp_path, "--top", "5", "--num-gpu-blocks", "64")  # (GPU-only; parsed)
    assert report["benchmark"] == "vllm_step_profile" and report["system"] == "vllm-plugin"
    assert report["prompts"] == 2 and report["max_tokens"] == 4 and report["tokens_per_s"] > 0


def test_step_profile_counts_steps_by_batch_size(tmp_path):
    """--host-times also counts the generate's steps: decode steps by batch size (the rows each product
    sees), and the prefill steps with their tokens. One prefill step of 16 tokens (it samples the first
    token), then 3 decode steps of 2 rows."""
    rows = _profile(tmp_path, "--host-times")["step_rows"]
    assert rows["prefill_steps"] == 1 and rows["prefill_step_tokens"] == rows["prompt_tokens"] == 16, rows
    assert rows["decode_steps"] == 3 and rows["decode_rows"]["1-64"] == 3, rows
    assert sum(rows["decode_rows"].values()) == rows["decode_steps"], rows
