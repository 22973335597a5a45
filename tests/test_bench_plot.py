"""bench.plot_peer draws the committed peer_vllm results (a ratio per system, stock vLLM as 1)."""
import json
from pathlib import Path

from bench.plot_peer import plot

# the results folder holds several benchmarks' files; each names its benchmark
RESULTS = [p for p in sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*/*.json"))
           if json.loads(p.read_text()).get("benchmark") == "peer_vllm"]


def test_plots_the_committed_results(tmp_path):
    assert RESULTS, "no committed peer_vllm results"
    out = plot(RESULTS, tmp_path / "peer.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_the_committed_decode_attention_results(tmp_path):
    from bench.plot_decode import plot as plot_decode
    files = [p for p in sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*/*.json"))
             if "decode_attention" in json.loads(p.read_text())]
    assert files, "no committed bench/kernels.py --only decode results"
    out = plot_decode(files, tmp_path / "decode.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
