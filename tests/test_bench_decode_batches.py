"""bench.decode_batches reports vLLM's schedule of a workload under a KV cache size: with room for every
sequence, one prefill step and one decode step per new token; with too little, preempted sequences are
recomputed and the decode runs in more, smaller steps."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _schedule(tmp_path, cache_tokens: int) -> dict:
    pytest.importorskip("vllm")
    out = tmp_path / f"batches-{cache_tokens}.json"
    proc = subprocess.run([sys.executable, "-m", "bench.decode_batches", "--prompts", "4", "--prompt-len", "24",
                           "--max-tokens", "40", "--cache-tokens", str(cache_tokens), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_decode_batches_with_room_for_every_sequence(tmp_path):
    report = _schedule(tmp_path, 4096)
    assert report["prefill_steps"] == 1 and report["prompt_tokens"] == 4 * 24 and report["recomputed_tokens"] == 0
    assert report["decode_steps"] == 39 and report["decode_rows_by_16"] == {"1-16": 39}, report
    assert report["decode_rows"]["1-64"] == 39


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_decode_batches_count_the_recompute_of_preempted_sequences(tmp_path):
    """4 sequences of up to 64 tokens in 4 blocks of 32: they cannot all grow, so vLLM preempts."""
    report = _schedule(tmp_path, 128)
    assert report["cache_tokens"] == 128
    assert report["recomputed_tokens"] > 0 and report["prefill_steps"] > 1, report
    assert report["decode_steps"] > 39, report
