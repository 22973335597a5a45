"""bench.speed_tables: every named table is a valid bench.peer_vllm run, and a table run with overrides
(a tiny checkpoint on CPU) reports the table's workload with the overrides applied."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer.systems import ALL_SYSTEMS, INTERLEAVABLE, INTERLEAVED_GPU_SHARE, interleaved_gpu_share
from bench.rollout import SHAPES
from bench.speed_tables import TABLES, main

ROOT = Path(__file__).resolve().parents[1]


def _option(args: list[str], name: str) -> str:
    return args[len(args) - 1 - args[::-1].index(name) + 1]  # the last value, as argparse keeps it


def test_every_table_names_known_shapes_and_systems(capsys):
    main(["--list"])
    listed = json.loads(capsys.readouterr().out)
    assert set(listed) == set(TABLES)
    for name, entry in listed.items():
        args = entry["peer_vllm"]
        assert _option(args, "--shape") in SHAPES, name
        assert set(_option(args, "--systems").split(",")) <= set(ALL_SYSTEMS), name
        assert "--stock-logprobs" in args, name  # every system returns log-probs, as a rollout must
    assert {"qwen1.5b-64", "qwen1.5b-256", "qwen1.5b-long", "llama8b-64", "llama8b-256", "llama8b-long"} <= set(TABLES)


def test_overrides_follow_the_table(capsys):
    main(["llama8b-tp4", "--dry-run", "--systems", "vllm"])
    args = json.loads(capsys.readouterr().out)
    assert _option(args, "--systems") == "vllm" and _option(args, "--tensor-parallel-size") == "4"


def test_host_bound_tables_run_round_robin(capsys):
    """Qwen2.5-1.5B's short steps make one process's figure a draw of its host speed: its tables run
    every system twice, round robin; the GPU-bound Llama tables once."""
    main(["--list"])
    listed = json.loads(capsys.readouterr().out)
    assert _option(listed["qwen1.5b-64"]["peer_vllm"], "--repeats") == "2"
    assert _option(listed["worker-off-placement"]["peer_vllm"], "--repeats") == "2"
    assert _option(listed["llama8b-256"]["peer_vllm"], "--repeats") == "1"


def test_interleaved_tables_fit_one_process():
    """An interleaved table names only systems that can share a process, and its engines' memory
    shares fit one GPU together (bench.peer_vllm refuses them otherwise, after the run has started)."""
    interleaved = {name: t for name, t in TABLES.items() if t.interleave}
    assert {"qwen1.5b-64-interleaved", "qwen1.5b-256-interleaved", "llama8b-256-interleaved"} <= set(interleaved)
    for name, table in interleaved.items():
        assert set(table.systems) <= set(INTERLEAVABLE) and table.tensor_parallel_size == 1, name
        assert interleaved_gpu_share(list(table.systems), table.gpu_memory_utilization) <= INTERLEAVED_GPU_SHARE, name
        assert "--interleave" in table.peer_args(), name


def test_a_table_can_fix_the_kv_cache(capsys):
    """The Llama interleaved table gives every engine an H100's cache, so an H200 runs its schedule."""
    main(["llama8b-256-interleaved", "--dry-run"])
    assert _option(json.loads(capsys.readouterr().out), "--num-gpu-blocks") == "7600"
    main(["llama8b-256", "--dry-run"])
    assert "--num-gpu-blocks" not in json.loads(capsys.readouterr().out)


def test_unknown_table_is_refused():
    with pytest.raises(SystemExit):
        main(["qwen1.5b-65"])


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_a_table_runs_on_cpu_with_a_tiny_checkpoint(tmp_path):
    """--model wins over the table's random-weight shape (a checkpoint vLLM's CPU attention takes)."""
    pytest.importorskip("vllm")
    from bench.peer.systems import TINY_KW
    from rollout_service.tiny_models import tiny_model
    tiny_model("qwen2", seed=0, **TINY_KW).save_pretrained(tmp_path / "model")
    out = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, "-m", "bench.speed_tables", "qwen1.5b-256", "--model", str(tmp_path / "model"),
                           "--prompts", "3", "--prompt-len", "10", "--max-tokens", "5", "--timed-runs", "2", "--repeats", "1",
                           "--systems", "vllm,native-verified", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["workload"] == dict(prompts=3, prompt_len=10, max_tokens=5, stock_logprobs=True,
                                      logprobs_layout="flat", temperature=1.0, top_p=1.0, lora_rank=0,
                                      kv_cache_mib=512)
    results = report["results"]
    assert set(results) == {"vllm", "native-verified"}
    for res in results.values():
        assert "error" not in res, res
        assert res["generated_tokens"] == 3 * 5 and len(res["timed_runs_s"]) == 2
    assert results["native-verified"]["x_vllm"] == round(
        results["native-verified"]["tokens_per_s"] / results["vllm"]["tokens_per_s"], 3)
