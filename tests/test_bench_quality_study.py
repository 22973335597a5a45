"""bench.quality_study: the arms' runs advance in resumable pieces (a second invocation continues from each run's
last checkpoint), the summary pairs the arms by seed, and every quantity gets its PNG. Figures are not asserted:
only what must hold whatever they are (zero KL on the canonical arm, nonzero KL on the stock ones)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.quality_study import QUANTITIES, ROUTING, main

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["train.prompts_per_step=8", "warmup.steps=5"]


def _record(step: int, reward: float, kl: float) -> dict:
    return {"step": step, "reward/mean": reward, "rollout_train/kl": kl, "rollout_train/max_abs_logprob_diff": kl,
            "train/clip_fraction": 0.0, "train/grad_norm": 1.0, "train/entropy": 2.0}


def test_finished_runs_are_summarised_paired_by_seed_without_running_anything(tmp_path, capsys):
    """Runs already done (metrics.jsonl with every step) are read back, not run again: no Ray is needed."""
    rewards = {("canonical", 0): [0.1, 0.2, 0.3, 0.4], ("canonical", 1): [0.0, 0.1, 0.2, 0.3],
               ("stock", 0): [0.1, 0.1, 0.1, 0.2], ("stock", 1): [0.0, 0.1, 0.2, 0.4]}
    for (arm, seed), values in rewards.items():
        run = tmp_path / "base" / f"{arm}-seed{seed}"
        run.mkdir(parents=True)
        kl = 0.0 if arm == "canonical" else 1e-3
        (run / "metrics.jsonl").write_text("".join(json.dumps(_record(i + 1, r, kl)) + "\n"
                                                   for i, r in enumerate(values)))
    summary = main(["--arms", "canonical,stock", "--seeds", "0,1", "--steps", "4", "--out", str(tmp_path)])
    assert json.loads(capsys.readouterr().out) == summary
    gap = summary["canonical_minus_arm_reward"]["stock"]  # quarters of 1 step: seed 0 and seed 1's differences
    assert [(w["steps"], round(w["min"], 9), round(w["max"], 9)) for w in gap] == [
        ([1, 1], 0.0, 0.0), ([2, 2], 0.0, 0.1), ([3, 3], 0.0, 0.2), ([4, 4], -0.1, 0.2)]
    assert summary["arms"]["stock"]["reward/mean"]["last_quarter_mean"] == pytest.approx(0.3)
    assert summary["arms"]["canonical"]["rollout_train/kl"]["max"] == 0.0
    assert sorted(Path(p).name for p in summary["plots"]) == sorted(q.replace("/", "_") + ".png" for q in QUANTITIES)
    assert all(Path(p).read_bytes()[:8] == PNG for p in summary["plots"])


def test_an_moe_studys_routing_agreement_is_summarised_and_plotted(tmp_path, capsys):
    """Runs that log the routing agreement (MoE policies) get it in the summary and a PNG of it; dense runs do
    not (the test above)."""
    for arm, agreement in (("canonical", 1.0), ("stock", 0.97)):
        run = tmp_path / "moe" / f"{arm}-seed0"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps({**_record(i + 1, 0.1, 0.0), ROUTING: agreement})
                                                   + "\n" for i in range(4)))
    summary = main(["--setting", "moe", "--arms", "canonical,stock", "--seeds", "0", "--steps", "4",
                    "--out", str(tmp_path)])
    capsys.readouterr()
    assert summary["arms"]["stock"][ROUTING]["last_quarter_mean"] == 0.97
    assert summary["arms"]["canonical"][ROUTING]["min"] == 1.0
    assert ROUTING.replace("/", "_") + ".png" in {Path(p).name for p in summary["plots"]}


def test_bad_arms_and_settings_are_refused_before_any_run(tmp_path):
    with pytest.raises(SystemExit):
        main(["--arms", "canonical,stock_is", "--out", str(tmp_path)])
    from recipes.config import ConfigError
    with pytest.raises(ConfigError, match="rollout.max_tokens"):
        main(["--out", str(tmp_path), "rollout.max_tokens=0"])
    assert not any((tmp_path / "base").iterdir())


def test_a_spent_budget_stops_before_the_next_piece(tmp_path):
    out = main(["--arms", "canonical", "--seeds", "0", "--steps", "2", "--budget-min", "-1", "--out", str(tmp_path)])
    assert out == {"done": False, "pending": ["canonical-seed0"]}


# the CLI's runs with one rollout worker and one trainer rank: the runs' actors start on two cores
ONE_OF_EACH = ["rollout.num_workers=1", "trainer.num_ranks=1"]


def _study(tmp_path: Path, *args: str) -> dict:
    env = {**os.environ, "RAY_ADDRESS": "local", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "bench.quality_study", "--out", str(tmp_path / "study"), "--seeds",
                           "0", *args, *TINY, *ONE_OF_EACH], check=False, cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_arms_run_and_a_second_invocation_resumes(tmp_path):
    # two of the four arms: zero KL, and the stock numerics with a correction (stock and stock_mask differ from
    # stock_tis only in the loss's correction, whose rules tests/test_recipe_units.py checks)
    arms = ["canonical", "stock_tis"]
    first = _study(tmp_path, "--steps", "1", "--arms", ",".join(arms))
    assert set(first["arms"]) == set(arms)
    assert first["arms"]["canonical"]["rollout_train/kl"]["max"] == 0.0
    assert first["arms"]["canonical"]["rollout_train/max_abs_logprob_diff"]["max"] == 0.0
    # the stock numerics' rollouts are not the trainer's
    assert first["arms"]["stock_tis"]["rollout_train/max_abs_logprob_diff"]["max"] > 0.0
    warm = tmp_path / "study" / "base" / "warm-seed0"  # one warm-up for the seed, every arm starting from it
    for arm in arms:
        assert f"name: {warm}" in (tmp_path / "study" / "base" / f"{arm}-seed0" / "config.yaml").read_text(), arm
    again = _study(tmp_path, "--arms", "canonical", "--steps", "2", "--piece-steps", "1")
    run = tmp_path / "study" / "base" / "canonical-seed0"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # step 2 from the resumed piece; step 1 not run again
    assert again["arms"]["canonical"]["rollout_train/kl"]["max"] == 0.0


def test_a_seed_is_warmed_once_and_every_arm_starts_from_that_checkpoint(tmp_path, monkeypatch):
    import torch

    import recipes.grpo_job
    from bench.quality_study import warm_start
    from recipes.config import load_config
    from recipes.models import initial_model
    from recipes.task import build_task
    config = "recipes/configs/tiny.yaml"
    overrides = warm_start(config, TINY, 3, tmp_path)
    assert overrides == ["model.source=hf", f"model.name={tmp_path / 'warm-seed3'}", "warmup.steps=0"]
    cfg = load_config(config, [*TINY, "seed=3"])
    task = build_task(cfg)
    warmed = recipes.grpo_job.starting_model(cfg, task, resumed=False)  # the run's own warm-up, on CPU
    loaded = initial_model(load_config(config, [*TINY, "seed=3", *overrides]), task.tokenizer)
    assert warmed.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in warmed.state_dict().items():
        assert torch.equal(tensor.view(torch.int16), loaded.state_dict()[name].view(torch.int16)), name
    untouched = initial_model(load_config(config, [*TINY, "seed=3"]), task.tokenizer)  # not warmed: differs
    assert any(not torch.equal(t, untouched.state_dict()[n]) for n, t in warmed.state_dict().items())

    def no_second_warmup(*args, **kwargs):
        raise AssertionError("the seed's warm-up ran again")
    monkeypatch.setattr(recipes.grpo_job, "starting_model", no_second_warmup)
    assert warm_start(config, TINY, 3, tmp_path) == overrides  # taken from disk
    assert warm_start(config, ["warmup.steps=0"], 3, tmp_path / "none") == []  # no warm-up, nothing saved
    assert not (tmp_path / "none").exists()
