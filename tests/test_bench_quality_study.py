"""bench.quality_study: the arms' runs advance in resumable pieces (a second invocation continues from each run's
last checkpoint), the summary pairs the arms by seed, and every quantity gets its PNG. Figures are not asserted:
only what must hold whatever they are (zero KL on the canonical arm, nonzero KL on the stock ones)."""
import json
import os
import subprocess
import time
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
    assert [(w["ahead"], w["behind"]) for w in gap] == [(0, 0), (1, 0), (1, 0), (1, 1)]
    whole = summary["canonical_minus_arm_reward_whole_run"]["stock"]  # seed 0: +0.125, seed 1: -0.025
    assert (whole["steps"], whole["ahead"], whole["behind"]) == ([1, 4], 1, 1)
    assert (whole["min"], whole["max"]) == (pytest.approx(-0.025), pytest.approx(0.125))
    assert summary["arms"]["stock"]["reward/mean"]["last_quarter_mean"] == pytest.approx(0.3)
    assert summary["arms"]["canonical"]["rollout_train/kl"]["max"] == 0.0
    assert sorted(Path(p).name for p in summary["plots"]) == sorted(
        [q.replace("/", "_") + ".png" for q in QUANTITIES] + ["reward_gap.png"])
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


def test_a_seeds_runs_wait_for_its_warm_up_and_other_seeds_do_not():
    from bench.quality_concurrent import next_startable
    pending = [("stock", 0), ("canonical", 1), ("stock", 1)]
    assert next_startable(pending, [("canonical", 0)], set()) == ("canonical", 1)  # seed 0 is being warmed
    assert next_startable(pending, [("canonical", 0)], {0}) == ("stock", 0)  # warmed: its arms run side by side
    assert next_startable(pending[:1], [("canonical", 0)], set()) is None
    assert next_startable(pending[:1], [], set()) == ("stock", 0)  # nobody warming seed 0: this run warms it


FAKE_RUN = """
import json, os, sys, time
root, arm, seed, steps, fail = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
run = os.path.join(root, f"{arm}-seed{seed}")
os.makedirs(run, exist_ok=True)
with open(os.path.join(root, "spans.txt"), "a") as f:
    f.write(f"{arm}-seed{seed} start {time.monotonic()}\\n")
warm = os.path.join(root, f"warm-seed{seed}")
assert not os.path.exists(os.path.join(warm, "busy")), "two runs warmed one seed at once"
if not os.path.exists(os.path.join(warm, "config.json")):
    os.makedirs(warm, exist_ok=True)
    open(os.path.join(warm, "busy"), "w").close()
    time.sleep(0.3)
    os.remove(os.path.join(warm, "busy"))
    open(os.path.join(warm, "config.json"), "w").write("{}")
time.sleep(0.3)
print("a step line")
if fail:
    sys.exit("this run broke")
with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps({"step": k + 1, "reward/mean": 0.5, "rollout_train/max_abs_logprob_diff": 0.25}) + "\\n"
                 for k in range(steps))
with open(os.path.join(root, "spans.txt"), "a") as f:
    f.write(f"{arm}-seed{seed} end {time.monotonic()}\\n")
"""


def test_concurrent_runs_stay_within_their_limit_and_a_failed_one_is_named(tmp_path, monkeypatch):
    """Child processes standing in for runs (the real CLI's are in the slow test below): never more than
    `concurrent` at once, one warm-up per seed, progress lines with each run's latest reward, and a child that
    fails is reported with its log's end while the others finish."""
    import bench.quality_concurrent as qc
    from bench.quality_study import latest, steps_done
    monkeypatch.setattr(qc, "POLL_S", 0.05)
    monkeypatch.setattr(qc, "PROGRESS_S", 0.2)
    runs = [(arm, seed) for seed in (0, 1) for arm in ("canonical", "stock", "stock_tis")]
    said = []

    def argv(arm, seed, minutes):
        fail = "1" if (arm, seed) == ("stock", 1) else "0"
        return [sys.executable, "-c", FAKE_RUN, str(tmp_path), arm, str(seed), "3", fail]

    failed = qc.run_concurrently(runs, 2, argv, tmp_path, True, 3, None, steps_done, latest, said.append)
    assert len(failed) == 1 and failed[0].startswith("stock-seed1 (exit 1; log ")
    assert any("stock-seed1 failed" in line and "this run broke" in line for line in said)
    assert any(line.startswith("canonical-seed0: 3/3 steps (reward 0.500, max |Δ log-prob| 0.25)") for line in said)
    assert any(line.startswith("steps so far: ") and "/3" in line for line in said)  # the running runs, every PROGRESS_S
    assert {(a, s) for a, s in runs if steps_done(tmp_path / f"{a}-seed{s}") == 3} == set(runs) - {("stock", 1)}
    assert "a step line" in (tmp_path / "logs" / "canonical-seed0.log").read_text()
    events = sorted((float(t), kind) for _, kind, t in (line.split() for line in (tmp_path / "spans.txt").read_text().splitlines()))
    live = peak = 0
    for _, kind in events:
        live += 1 if kind == "start" else -1
        peak = max(peak, live)
    assert peak == 2  # two at once, never three


def test_no_run_starts_once_the_budget_is_spent(tmp_path):
    from bench.quality_concurrent import run_concurrently
    from bench.quality_study import latest, steps_done

    def argv(*_):
        raise AssertionError("a run started after the deadline")
    failed = run_concurrently([("canonical", 0)], 2, argv, tmp_path, False, 1, time.monotonic() - 1, steps_done,
                              latest, lambda _: None)
    assert failed == [] and steps_done(tmp_path / "canonical-seed0") == 0


@pytest.mark.slow
def test_concurrent_runs_give_the_sequential_studys_numbers(tmp_path):
    """--concurrent 2: each run in a process (and a Ray) of its own, the same steps as one after another."""
    arms = ["canonical", "stock_tis"]
    for way in ("together", "apart"):
        (tmp_path / way).mkdir()
    together = _study(tmp_path / "together", "--steps", "1", "--arms", ",".join(arms), "--concurrent", "2")
    apart = _study(tmp_path / "apart", "--steps", "1", "--arms", ",".join(arms))
    assert together["arms"]["canonical"]["rollout_train/kl"]["max"] == 0.0
    assert together["arms"]["stock_tis"]["rollout_train/max_abs_logprob_diff"]["max"] > 0.0
    for arm in arms:
        runs = [tmp_path / way / "study" / "base" / f"{arm}-seed0" / "metrics.jsonl" for way in ("together", "apart")]
        a, b = ([{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                 for line in run.read_text().splitlines()] for run in runs)
        assert a == b, arm
    assert (tmp_path / "together" / "study" / "base" / "logs" / "stock_tis-seed0.log").is_file()
