"""bench.verl_plot: each arm's bar is one step that ran, split into verl's timers with the rest as "other"."""
from __future__ import annotations

import json

from bench import verl_plot


def arm(steps, gen, old, update):
    return {"timing_s": {"step": steps, "gen": gen, "old_log_prob": old, "update_actor": update}}


def document(shape="qwen1.5b"):
    return {"verl": "0.9.1", "shape": shape, "settings": {"train_batch_size": 16},
            "rounds": [{"order": ["verl", "zerokl"],
                        "verl": arm([80.0, 50.0, 46.0], [10.0, 4.0, 6.0], [8.0, 7.0, 6.5], [20.0, 25.0, 24.0]),
                        "zerokl": arm([60.0, 19.0], [14.0, 6.0], [0.1, 0.05], [12.0, 8.0])}]}


def test_the_split_is_a_step_that_ran_and_sums_to_it():
    doc = document()
    verl, zerokl = (verl_plot.step_split(doc["rounds"][0][a]) for a in ("verl", "zerokl"))
    # steps 2 and 3 after the first: the lower middle (46.0, the third step) with that step's own timers
    assert verl == {"gen": 6.0, "old_log_prob": 6.5, "update_actor": 24.0, "other": 46.0 - 36.5}
    assert zerokl["update_actor"] == 8.0 and abs(sum(zerokl.values()) - 19.0) < 1e-9
    one_step = verl_plot.step_split(arm([70.0], [5.0], [6.0], [80.0]))  # timers above the step: other is 0
    assert one_step["other"] == 0.0 and one_step["gen"] == 5.0


def test_bars_follow_each_rounds_order_and_the_png_is_written(tmp_path):
    docs = [document("quickstart"), document()]
    labels = [label for label, _ in verl_plot.bars(docs)]
    assert labels == ["quickstart (16 prompts)\nverl, round 0", "quickstart (16 prompts)\nzerokl, round 0",
                      "qwen1.5b (16 prompts)\nverl, round 0", "qwen1.5b (16 prompts)\nzerokl, round 0"]
    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"doc{i}.json")
        paths[-1].write_text(json.dumps(doc))
    out = tmp_path / "steps.png"
    verl_plot.main([str(p) for p in paths] + ["--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
