"""bench.peer_vllm on CPU with its embedded tiny model: each system runs in its own process and the
report holds every system's tokens/s and its ratio to stock vLLM in the same run; a run cut off after
some systems has still written what it measured."""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from bench.peer.engines import request_params  # noqa: E402
from bench.peer.report import build_report  # noqa: E402
from bench.peer.systems import interleaved_gpu_share  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_systems_in_one_run(tmp_path):
    """Each system's engine core in a process of its own, vLLM's default placement: the plugin is then found
    through its entry point. (Engine cores in the bench's process: the interleaved test below.)"""
    engine_core = "own-process"
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, "-m", "bench.peer_vllm", "--prompts", "3", "--prompt-len", "12",
                           "--max-tokens", "6", "--systems", "vllm,vllm-plugin", "--engine-core", engine_core,
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report and "complete" not in report
    assert report["engine_core"] == engine_core
    results = report["results"]
    assert set(results) == {"vllm", "vllm-plugin"}, results
    for res in results.values():
        assert "error" not in res, res
        assert res["generated_tokens"] == 3 * 6 and res["tokens_per_s"] > 0
        assert res["kv_cache_tokens"] >= 3 * (12 + 6), res  # the KV cache vLLM sized, in tokens
    assert results["vllm"]["x_vllm"] == 1.0
    assert results["vllm-plugin"]["x_vllm"] == round(
        results["vllm-plugin"]["tokens_per_s"] / results["vllm"]["tokens_per_s"], 3)


def _assert_pass_ratios(ratios, times, stock_times):
    """Each pass's ratio is stock's pass over this one, up to rounding: the times are kept to 0.1 ms
    and the ratios to 3 decimals, so each ratio must lie in the interval those roundings allow."""
    half = 0.5e-4
    assert len(ratios) == len(times) == len(stock_times)
    for ratio, x, b in zip(ratios, times, stock_times):
        assert (b - half) / (x + half) - 5e-4 <= ratio <= (b + half) / (x - half) + 5e-4, (ratio, x, b)


@pytest.mark.slow
def test_interleaved_systems_share_one_process_and_take_turns(tmp_path):
    """--interleave: stock vLLM and the plugin in one process per round, their passes in turn; each
    pass's ratio to stock's pass of the same turn is reported, and the round's output is one log."""
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, "-m", "bench.peer_vllm", "--prompts", "3", "--prompt-len", "12",
                           "--max-tokens", "6", "--timed-runs", "3", "--systems", "vllm,vllm-plugin", "--interleave",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["interleaved"] is True
    assert report["workload"]["stock_logprobs"] is True  # the default: stock returns log-probs, as ours do
    results = report["results"]
    assert set(results) == {"vllm", "vllm-plugin"}, results
    for res in results.values():
        assert "error" not in res, res
        assert res["generated_tokens"] == 3 * 6 and len(res["timed_runs_s"]) == 3
    stock, plugin = results["vllm"]["timed_runs_s"], results["vllm-plugin"]["timed_runs_s"]
    assert results["vllm"]["passes_x_vllm"] == [1.0] * 3
    _assert_pass_ratios(results["vllm-plugin"]["passes_x_vllm"], plugin, stock)
    assert results["vllm-plugin"]["x_vllm_all_passes"] == pytest.approx(sum(stock) / sum(plugin), rel=0.05)
    assert results["vllm-plugin"]["x_vllm_passes_median"] == sorted(results["vllm-plugin"]["passes_x_vllm"])[1]
    assert results["vllm-plugin"]["process_wall_s"] == results["vllm"]["process_wall_s"]  # one process
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer.interleaved.log", "peer.json"]


@pytest.mark.slow
def test_the_worker_off_takes_turns_with_stock_vllm_in_one_process(tmp_path):
    """worker-off interleaves too: VLLMEngine's stock engine serves its off requests in the same
    process as stock vLLM's own engine, pass for pass."""
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, "-m", "bench.peer_vllm", "--prompts", "3", "--prompt-len", "12",
                           "--max-tokens", "6", "--timed-runs", "2", "--systems", "worker-off,vllm", "--interleave",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    for res in results.values():
        assert "error" not in res, res
        assert res["generated_tokens"] == 3 * 6 and len(res["passes_x_vllm"]) == 2
    stock, off = results["vllm"]["timed_runs_s"], results["worker-off"]["timed_runs_s"]
    _assert_pass_ratios(results["worker-off"]["passes_x_vllm"], off, stock)


@pytest.mark.parametrize("flags, stock_logprobs", [([], 0), (["--stock-logprobs"], 0), (["--no-stock-logprobs"], None)])
def test_stock_requests_ask_for_the_log_probs_ours_return(flags, stock_logprobs):
    """By default stock vLLM's requests return each token's log-prob (an RL rollout needs it, and the plugin's
    requests always do), so the two systems do the same work; --no-stock-logprobs drops it from stock's only."""
    from bench.peer_vllm import parser
    args = parser().parse_args(["--max-tokens", "4", *flags])
    prompts = [[1, 2, 3], [4, 5]]
    assert [sp.logprobs for sp in request_params(args, "vllm", prompts)] == [stock_logprobs] * 2
    assert [sp.logprobs for sp in request_params(args, "vllm-plugin", prompts)] == [0, 0]


def test_interleaved_engines_memory_share():
    assert interleaved_gpu_share(["vllm", "vllm-plugin"], 0.4) == pytest.approx(0.8)
    assert interleaved_gpu_share(["vllm", "vllm-plugin", "worker-off"], 0.22) == pytest.approx(0.88)


@pytest.mark.parametrize("systems", ["vllm,worker-verified", "vllm,vllm-batch-invariant"])
def test_interleave_refuses_systems_that_need_a_process_of_their_own(systems):
    proc = subprocess.run([sys.executable, "-m", "bench.peer_vllm", "--systems", systems, "--interleave"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--interleave runs" in proc.stderr, proc.stderr[-1000:]


def test_partial_report_is_written_and_marked(tmp_path):
    args = argparse.Namespace(tensor_parallel_size=1, engine_core="in-process", interleave=False, prompts=2, prompt_len=4,
                              max_tokens=3, stock_logprobs=True, logprobs_layout="flat", temperature=1.0, top_p=1.0,
                              window=8, group=8, kv_cache_mib=512, gpu_memory_utilization=0.4, num_gpu_blocks=None, lora=0)
    runs = {"vllm": [dict(generated_tokens=6, seconds=2.0, tokens_per_s=3.0)], "vllm-plugin": []}
    path = tmp_path / "partial.json"
    report = build_report(args, "tiny", runs, str(path))
    assert json.loads(path.read_text()) == report
    assert report["complete"] is False and set(report["results"]) == {"vllm"}
    assert report["results"]["vllm"]["x_vllm"] == 1.0
    assert report["workload"]["logprobs_layout"] == "flat"


def test_repeats_report_each_rounds_ratio_to_stock(tmp_path):
    """Round robin: the median run per system, and each round's ratio to stock's run of that round
    (a round whose run failed has none)."""
    args = argparse.Namespace(tensor_parallel_size=1, engine_core="in-process", interleave=False, prompts=2, prompt_len=4,
                              max_tokens=3, stock_logprobs=True, logprobs_layout="flat", temperature=1.0, top_p=1.0,
                              window=8, group=8, kv_cache_mib=512, gpu_memory_utilization=0.4, num_gpu_blocks=None, lora=0)

    def run(tps):
        return dict(generated_tokens=6, seconds=6 / tps, tokens_per_s=tps)
    runs = {"vllm": [run(10.0), run(20.0), run(10.0)],
            "worker-off": [run(9.0), run(20.0), dict(error="RuntimeError: boom")]}
    results = build_report(args, "tiny", runs)["results"]
    off = results["worker-off"]
    assert off["runs_tokens_per_s"][:2] == [9.0, 20.0] and off["tokens_per_s"] == 9.0  # median of the two that ran
    assert off["x_vllm"] == 0.9  # against stock's median run, 10.0
    assert off["rounds_x_vllm"] == [0.9, 1.0] and off["x_vllm_rounds_median"] == 0.95
    assert results["vllm"]["rounds_x_vllm"] == [1.0, 1.0, 1.0]


def test_a_failed_system_names_its_error_and_keeps_its_log(tmp_path):
    """A system that dies reports the error lines of its output (not only vLLM's "see root cause
    above"), its whole output stays in <out>.<system>.log, and the systems after it still run."""
    (tmp_path / "not-a-checkpoint").mkdir()
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, "-m", "bench.peer_vllm", "--model", str(tmp_path / "not-a-checkpoint"),
                           "--systems", "vllm,native-off", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"vllm", "native-off"}
    for system, res in results.items():
        assert res["error"].startswith("exit "), res
        assert any("config.json" in line for line in res["causes"]), res["causes"]
        assert "Traceback" in (tmp_path / f"peer.{system}.log").read_text()


def test_a_hung_system_is_stopped_at_its_timeout(tmp_path):
    out = tmp_path / "results" / "peer.json"  # --out may name a folder that does not exist yet
    proc = subprocess.run([sys.executable, "-m", "bench.peer_vllm", "--prompts", "2", "--prompt-len", "8",
                           "--max-tokens", "4", "--systems", "vllm", "--timeout", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"]["vllm"]
    assert res["error"] == "timed out after 2 s" and res["process_wall_s"] < 60, res


def test_a_process_stuck_after_its_result_is_killed_and_its_result_kept():
    """A system that measured but does not exit (seen: vLLM's TP = 4 teardown) is killed `grace`
    seconds after its RESULT line, not at the timeout; one that exits is not stopped, even while a
    child of its own keeps the output pipe open."""
    from bench.peer.processes import supervise
    stuck = "import time; print('RESULT {}', flush=True); time.sleep(120)"
    start = time.perf_counter()
    output, stopped, _ = supervise([sys.executable, "-c", stuck], dict(os.environ), timeout=300, grace=1)
    assert "RESULT {}" in output and stopped.startswith("killed 1 s after its result"), stopped
    assert time.perf_counter() - start < 60
    orphan = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
              "print('RESULT {}', flush=True)")
    start = time.perf_counter()
    output, stopped, returncode = supervise([sys.executable, "-c", orphan], dict(os.environ), timeout=300, grace=100)
    assert "RESULT {}" in output and stopped is None and returncode == 0
    assert time.perf_counter() - start < 60


def test_error_lines_keep_the_last_distinct_errors_in_order():
    from bench.peer.processes import error_lines
    output = "\n".join(["INFO start", "Traceback (most recent call last):", "ValueError: first",
                        "INFO more", "RuntimeError: Engine core initialization failed", "ValueError: first",
                        'RESULT {"error": "RuntimeError"}'])
    assert error_lines(output) == ["RuntimeError: Engine core initialization failed", "ValueError: first"]
    assert error_lines(output, keep=1) == ["ValueError: first"]


@pytest.mark.slow
def test_lora_runs_every_request_with_one_adapter_in_both_systems(tmp_path):
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, "-m", "bench.peer_vllm", "--prompts", "3", "--prompt-len", "12",
                           "--max-tokens", "6", "--systems", "vllm,vllm-plugin", "--lora", "8", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["workload"]["lora_rank"] == 8
    for res in report["results"].values():
        assert "error" not in res and res["generated_tokens"] == 3 * 6, res


def test_lora_refuses_systems_without_vllms_lora():
    proc = subprocess.run([sys.executable, "-m", "bench.peer_vllm", "--systems", "vllm,native-verified", "--lora", "8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--lora runs the systems" in proc.stderr, proc.stderr[-1000:]
