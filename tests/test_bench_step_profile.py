"""bench.vllm_step_profile runs end to end on CPU (a tiny checkpoint through the plugin) and takes
bench.peer_vllm's engine options, so the tool the GPU profiles depend on cannot drift from them unnoticed."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_step_profile_reports_a_plugin_generate(tmp_path):
    pytest.importorskip("vllm")
    from bench.peer_vllm import TINY_KW
    from rollout_service.tiny_models import tiny_model
    tiny_model("qwen2", seed=0, **TINY_KW).save_pretrained(tmp_path / "model")
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "bench.vllm_step_profile", "--model", str(tmp_path / "model"),
                           "--system", "vllm-plugin", "--prompts", "2", "--prompt-len", "8", "--max-tokens", "4",
                           "--top", "5", "--num-gpu-blocks", "64", "--out", str(out)],  # (GPU-only; parsed)
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "vllm_step_profile" and report["system"] == "vllm-plugin"
    assert report["prompts"] == 2 and report["max_tokens"] == 4 and report["tokens_per_s"] > 0
