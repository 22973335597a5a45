"""bench.plot_peer draws the committed peer_vllm results (a ratio per system, stock vLLM as 1)."""
import json
from pathlib import Path

from bench.plot_peer import figure, plot

# the results folder holds several benchmarks' files; each names its benchmark
RESULTS = [p for p in sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*/*.json"))
           if json.loads(p.read_text()).get("benchmark") == "peer_vllm"]


def test_plots_the_committed_results(tmp_path):
    assert RESULTS, "no committed peer_vllm results"
    out = plot(RESULTS, tmp_path / "peer.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _paired_passes(path: Path) -> list[float]:
    """The pass ratios an --interleave run holds for its systems other than stock vLLM ([] otherwise)."""
    results = json.loads(path.read_text())["results"]
    return [x for s, r in results.items() if s != "vllm" and isinstance(r, dict) for x in r.get("passes_x_vllm", [])]


def test_interleaved_runs_show_each_paired_pass():
    """Every pass ratio of an --interleave run is one dot on the plot; a run of separate processes adds none."""
    interleaved = [p for p in RESULTS if _paired_passes(p)]
    separate = [p for p in RESULTS if not _paired_passes(p)]
    assert interleaved and separate
    drawn = figure(interleaved + separate[:2]).axes[0].collections
    assert sum(len(c.get_offsets()) for c in drawn) == sum(len(_paired_passes(p)) for p in interleaved)
    assert not figure(separate[:2]).axes[0].collections


def test_plots_the_committed_decode_attention_results(tmp_path):
    from bench.plot_decode import plot as plot_decode
    files = [p for p in sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*/*.json"))
             if "decode_attention" in json.loads(p.read_text())]
    assert files, "no committed bench/kernels.py --only decode results"
    out = plot_decode(files, tmp_path / "decode.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
