"""bench.plot_peer draws the committed peer_vllm results (a ratio per system, stock vLLM as 1)."""
from pathlib import Path

from bench.plot_peer import plot

RESULTS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*/*.json"))


def test_plots_the_committed_results(tmp_path):
    assert RESULTS, "no committed peer_vllm results"
    out = plot(RESULTS, tmp_path / "peer.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
