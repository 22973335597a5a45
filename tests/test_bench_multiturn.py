"""bench.multiturn on CPU with its tiny model, stock vLLM and the plugin in turns: the JSON it prints has every
field, and they agree with each other and with the workload (token counts, the prefill split, the prefix
cache's hits on the second turn, tokens/s and the paired ratios); not its speed."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
EPISODES, TURNS, PROMPT, MAX_TOKENS, OBSERVATION, ROUNDS, BLOCK = 3, 2, 40, 8, 5, 2, 32


@pytest.mark.slow  # 20-30 s on a 2-core machine: the fast suite stays under 20 minutes
def test_two_turn_episodes_report(tmp_path):
    out = tmp_path / "multiturn.json"
    proc = subprocess.run([sys.executable, "-m", "bench.multiturn", "--episodes", str(EPISODES), "--turns", str(TURNS),
                           "--prompt-len", str(PROMPT), "--max-tokens", str(MAX_TOKENS), "--observation-len",
                           str(OBSERVATION), "--rounds", str(ROUNDS), "--block-size", str(BLOCK), "--kv-cache-mib", "64",
                           "--systems", "vllm-plugin,vllm", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # stdout is the JSON alone (vLLM's logs go to stderr)
    assert report == json.loads(out.read_text())
    assert "round 1 vllm-plugin" in proc.stderr  # progress
    assert (report["episodes"], report["turns"], report["rounds"]) == (EPISODES, TURNS, ROUNDS)
    results = report["results"]
    assert set(results) == {"vllm-plugin", "vllm"}, results

    # turn t's request is the prompt and t turns with their observations
    prompt_tokens = EPISODES * sum(PROMPT + t * (MAX_TOKENS + OBSERVATION) for t in range(TURNS))
    # the second turn takes every full block its first computed (the prompt and all but the last sampled token)
    cached = EPISODES * BLOCK * ((PROMPT + MAX_TOKENS - 1) // BLOCK)
    for name, res in results.items():
        assert "error" not in res, (name, res)
        assert res["model_tokens"] == res["decode_tokens"] == EPISODES * TURNS * MAX_TOKENS
        assert res["observation_tokens"] == EPISODES * (TURNS - 1) * OBSERVATION
        assert res["turns_run"] == EPISODES * TURNS
        assert res["prefill"] == {"prompt_tokens": prompt_tokens, "cached_tokens": cached,
                                  "computed_tokens": prompt_tokens - cached}, name
        cache = res["prefix_cache"]
        assert cache["hit_rate"] == cached / prompt_tokens
        assert cache["turn_hit_rate"][0] == 0.0 and cache["turn_hit_rate"][1] == cache["later_turns_hit_rate"] > 0
        assert len(res["turn_seconds"]) == TURNS and len(res["passes_s"]) == len(res["passes_tokens_per_s"]) == ROUNDS
        assert res["tokens_per_s"] == res["model_tokens"] / res["seconds"]
        assert res["seconds"] in res["passes_s"] and res["tokens_per_s"] in res["passes_tokens_per_s"]
        assert sum(res["turn_seconds"]) <= res["seconds"] + 1e-3
        assert res["engine"]["prefix_caching"] is True

    ratio = report["ratios"]["vllm-plugin/vllm"]
    plugin, stock = results["vllm-plugin"], results["vllm"]
    assert ratio["passes"] == [a / b for a, b in zip(plugin["passes_tokens_per_s"], stock["passes_tokens_per_s"])]
    assert ratio["median"] == statistics.median(ratio["passes"])
    assert ratio["all_passes"] == pytest.approx(sum(stock["passes_s"]) / sum(plugin["passes_s"]), rel=1e-12)
