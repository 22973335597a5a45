"""bench.grpo_step runs the tiny recipe's arms on CPU, one call each (--arms), and joins them (--merge):
the zero-KL arm's KL and max |Δ| are exactly 0, the stock arm's are not, every step part has its
median, and the joined round has their ratio. Completion budgets drawn per request (lognormal) are
the recipe's, plotted with --plot-lengths; train tokens/s, MFU and peak memory where logged."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[1]
# each request's max_tokens drawn from a log-normal (recipes.rollouts.completion_budget)
LOGNORMAL = ["rollout.length_distribution=lognormal", "rollout.length_median=6", "rollout.length_sigma=0.6",
             "rollout.max_tokens=12"]


def _bench(args: list[str], env: dict, tmp_path: Path, out: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.grpo_step", *args], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp_path / out).write_text(proc.stdout[proc.stdout.index("{"):])
    return json.loads((tmp_path / out).read_text())


@pytest.mark.slow
def test_bench_grpo_step_cpu_smoke(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": "local", "HOME": str(tmp_path)}  # runs land in tmp_path/zerokl-runs
    common = ["--device", "cpu", "--steps", "2", "--rounds", "1", "trainer.weight_push.transport=broadcast", *LOGNORMAL]
    parts = [_bench([*common, "--arms", arm, *(["--plot-lengths", str(tmp_path / "lengths.png")] * (arm == "stock"))],
                    env, tmp_path, f"{arm}.json") for arm in ("canonical", "stock")]
    assert all("stock_over_canonical_step_median" not in p for p in parts)  # one arm: no ratio
    drawn = parts[1]["drawn_lengths"]
    assert drawn["distribution"] == "lognormal" and drawn["count"] == 2 * 8 * 8 and drawn["max"] <= 12
    assert (tmp_path / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = _bench(["--merge", str(tmp_path / "canonical.json"), str(tmp_path / "stock.json")], env, tmp_path,
                 "both.json")
    [row] = out["rounds"]
    canonical, stock = row["canonical"], row["stock"]
    assert canonical["max_kl"] == 0.0 and canonical["max_abs_logprob_diff"] == 0.0
    assert stock["max_abs_logprob_diff"] > 0.0
    for arm in (canonical, stock):
        assert arm["steps"] == 2 and arm["step_s"] > 0 and arm["rollout_s"] > 0 and arm["train_s"] > 0
        assert arm["train_tokens_per_s"] > 0 and "train_mfu" not in arm and "train_peak_memory_gib" not in arm
        assert 1 <= arm["completion_length_min"] <= arm["completion_length_median"] <= arm["completion_length_max"]
        assert arm["completion_length_max"] <= drawn["max"]  # a completion stops at its drawn budget
        phases = arm["sync_phases_s"]
        sender = {"connect", "check", "begin", "send", "finish"}
        worker = {f"worker_{p}" for p in ("receive", "check", "wake", "load", "settle", "engine")}
        assert set(phases) == sender | worker | {"begin_pool", "begin_checks", "worker_begin", "push", "armed_ahead",
                                                 "finish_pool"}
        assert sum(phases[p] for p in sender) <= phases["push"] * 1.0001
        assert phases["finish_pool"] <= phases["finish"]
        # begin, nested: armed as the train step began, the pool's share ran while the ranks trained
        assert phases["armed_ahead"] >= arm["train_s"] * 0.5
        assert phases["worker_begin"] <= phases["begin_pool"] <= phases["armed_ahead"] + phases["begin"]
        assert phases["begin_checks"] <= phases["begin_pool"]
        # each phase of the workers' share (the slowest worker's, per phase) runs between the pool's begin
        # and its verdict
        assert all(phases[p] <= phases["begin"] + phases["send"] + phases["finish"] for p in worker)
        assert arm["samples_per_s"] > 0 and len(arm["reward_curve"]) == 2
        assert arm["reward_curve"][0][0] == 0.0 < arm["reward_curve"][1][0]  # seconds after the first step
    assert row["stock_over_canonical_step"] == stock["step_s"] / canonical["step_s"]
    for arm in (canonical, stock):  # the summed steps: the reward curve's last elapsed time
        assert arm["steps_after_first_s"] == pytest.approx(arm["reward_curve"][-1][0], abs=1e-4)
    assert row["stock_over_canonical_steps_summed"] == stock["steps_after_first_s"] / canonical["steps_after_first_s"]
    assert out["stock_over_canonical_step_median"] == row["stock_over_canonical_step"]
    tokens_ratio = canonical["train_tokens_per_s"] / stock["train_tokens_per_s"]
    assert row["canonical_over_stock_train_tokens_per_s"] == tokens_ratio
    assert out["canonical_over_stock_train_tokens_per_s_median"] == tokens_ratio


# the bench's CLI in a Ray session that declares two GPUs: Ray places actors that ask for GPU shares, and
# tells each the ids it gave it, as on a two-GPU machine (the engines and ranks still compute on the CPU)
TWO_RAY_GPUS = ("import sys, ray; ray.init(address='local', num_cpus=4, num_gpus=2, include_dashboard=False, "
                "log_to_driver=False); from bench.grpo_step import main; main()")
ON_TWO_GPUS = {  # placement: (overrides, whether rank i shares worker i's GPU)
    "split": (["rollout.num_workers=1", "trainer.num_ranks=1", "rollout.engine.device=cpu",
               "rollout.resources_per_worker.num_gpus=1", "trainer.placement.resources_per_rank.num_gpus=1"], False),
    "colocated": (["placement=colocated", "rollout.engine.device=cpu", "rollout.resources_per_worker.num_gpus=0.5",
                   "trainer.placement.resources_per_rank.num_gpus=0.5"], True)}


@pytest.mark.slow
@pytest.mark.parametrize("placement", ON_TWO_GPUS)
def test_bench_grpo_step_interleaved_cpu(tmp_path, placement):
    """--interleave: both arms' jobs in one process take steps in turns, the order alternating step to
    step; every step after the first is paired with the other arm's; KL as in runs of their own. On two
    GPUs both arms take half of each GPU their placement gives one job: split, both workers share one
    and both ranks the other (no worker on its rank's GPU); colocated, worker i and rank i share GPU i."""
    overrides, shared = ON_TWO_GPUS[placement]
    env = {**os.environ, "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", TWO_RAY_GPUS, "--device", "cpu", "--steps", "2", "--interleave",
                           "--plot", str(tmp_path / "turns.png"), "trainer.weight_push.transport=broadcast", *overrides],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # the jobs' own lines went to stderr
    turns = [m.groups() for m in re.finditer(r"^\[bench\] (\w+) step (\d+):", proc.stderr, re.M)]
    assert turns == [("canonical", "1"), ("stock", "1"), ("stock", "2"), ("canonical", "2")]
    [row] = out["rounds"]
    assert row["interleaved"] is True and row["order"] == ["canonical", "stock"]
    canonical, stock = row["canonical"], row["stock"]
    assert canonical["max_kl"] == 0.0 and canonical["max_abs_logprob_diff"] == 0.0
    assert stock["max_abs_logprob_diff"] > 0.0
    assert len(canonical["step_seconds"]) == len(stock["step_seconds"]) == 2
    assert row["stock_over_canonical_per_step"] == [s / c for s, c in zip(stock["step_seconds"][1:],
                                                                            canonical["step_seconds"][1:])]
    assert out["stock_over_canonical_per_step_median"] == row["stock_over_canonical_per_step_median"]
    assert (tmp_path / "turns.png").stat().st_size > 0
    gpus = canonical["gpus"]
    assert stock["gpus"] == gpus  # the arms share each GPU
    assert sorted(gpus["rollout"] + gpus["trainer"]) == (["0", "0", "1", "1"] if shared else ["0", "1"])
    assert (gpus["rollout"] == gpus["trainer"]) is shared


def test_split_arms_whose_worker_shares_its_ranks_gpu_are_refused():
    from bench.grpo_arms.run import check_split_gpus
    apart = {"canonical": {"rollout": ["0"], "trainer": ["1"]}, "stock": {"rollout": ["0"], "trainer": ["1"]}}
    check_split_gpus("split", apart)
    packed = {"canonical": {"rollout": ["0"], "trainer": ["0"]}, "stock": {"rollout": ["1"], "trainer": ["1"]}}
    check_split_gpus("colocated", packed)  # sharing is what colocated means
    with pytest.raises(RuntimeError, match=r"canonical: split placement, but .* share GPUs \['0'\]"):
        check_split_gpus("split", packed)


def test_interleave_refuses_async_arms():
    proc = subprocess.run([sys.executable, "-m", "bench.grpo_step", "--interleave", "--arms", "canonical,async"],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "an async arm generates between its steps" in proc.stderr


def test_merge_refuses_runs_that_do_not_pair():
    from bench.grpo_arms.ratios import merge
    run = {"config": "c.yaml", "steps": 3, "overrides": [], "rounds": [{"canonical": {"step_s": 1.0}}]}
    with pytest.raises(ValueError, match="differ"):
        merge([run, {**run, "steps": 4}])
    with pytest.raises(ValueError, match="twice"):
        merge([run, run])


def test_merged_one_step_runs_pair_their_step_and_leave_the_later_steps_out():
    """--steps 1 (a long-completion run that only has to fit): no step after the first, so no summed ratio."""
    from bench.grpo_arms.ratios import merge
    def run(arm, step_s):
        return {"config": "c.yaml", "steps": 1, "overrides": [],
                "rounds": [{arm: {"step_s": step_s, "steps_after_first_s": 0, "step_seconds": [step_s]}}]}
    row = merge([run("canonical", 2.0), run("stock", 3.0)])["rounds"][0]
    assert row["stock_over_canonical_step"] == 1.5 and "stock_over_canonical_steps_summed" not in row


def test_time_to_reward_is_the_first_step_at_the_reward_both_arms_reached():
    from bench.grpo_arms.ratios import with_ratios
    from bench.grpo_arms.summary import time_to_reward
    # rewards per step, one second a step (sync) and half a second (async); trailing means of 3 steps
    sync = [[float(i + 1), r] for i, r in enumerate([0.1, 0.2, 0.3, 0.5, 0.6, 0.7])]  # last mean 0.6
    fast = [[0.5 * (i + 1), r] for i, r in enumerate([0.1, 0.1, 0.2, 0.3, 0.4, 0.5])]  # last mean 0.4
    row = {"canonical": {"reward_curve": sync, "step_s": 1.0}, "async": {"reward_curve": fast, "step_s": 0.5}}
    got = time_to_reward(row, ("canonical", "async"))
    assert got["target_reward"] == pytest.approx(0.4)
    assert got["canonical_s"] == 5.0  # mean(0.3, 0.5, 0.6) = 0.467 at step 5; step 4's is 0.333
    assert got["async_s"] == 3.0  # reached at its last step
    assert got["canonical_over_async"] == 5.0 / 3.0
    out = with_ratios({"rounds": [row]})
    assert out["rounds"][0]["time_to_reward_canonical_vs_async"] == got
    assert out["canonical_over_async_step_median"] == 2.0
    assert time_to_reward({"canonical": row["canonical"]}, ("canonical", "async")) is None


def test_rounds_take_the_arms_in_turns_and_odd_rounds_reverse_them(monkeypatch, capsys):
    """On GPUs the arm that ran second was seen to run faster; with an even number of rounds each pair
    of arms runs in both orders, and each round says which it ran."""
    import bench.grpo_step as bench

    ran = []
    monkeypatch.setattr(bench, "run_arm", lambda config, arm, steps, extra, run_dir: ran.append(arm) or arm)
    monkeypatch.setattr(bench, "summarise", lambda arm: {"step_s": {"canonical": 2.0, "stock": 3.0}[arm]})
    monkeypatch.setattr(sys, "argv", ["grpo_step", "--rounds", "3", "--arms", "canonical,stock"])
    bench.main()
    out = json.loads(capsys.readouterr().out)
    assert ran == ["canonical", "stock", "stock", "canonical", "canonical", "stock"]
    assert [r["order"] for r in out["rounds"]] == [["canonical", "stock"], ["stock", "canonical"],
                                                   ["canonical", "stock"]]
    assert [r["stock_over_canonical_step"] for r in out["rounds"]] == [1.5, 1.5, 1.5]


def _record(step: int, train_tps: float, gpu: bool, lengths: tuple[int, int, int]) -> dict:
    """A step record as recipes.metrics.step_metrics logs it (the keys bench.grpo_step reads)."""
    median, low, high = lengths
    rec = {"step": step, "perf/rollout_s": 1.0, "perf/train_s": 2.0, "perf/weight_sync_s": 0.5, "perf/sleep_s": 0.0,
           "perf/step_s": 4.0, "perf/rollout_tokens_per_s": 100.0, "perf/train_tokens_per_s": train_tps,
           "rollout_train/kl": 0.0, "rollout_train/max_abs_logprob_diff": 0.0, "reward/mean": 0.1 * step,
           "rollout/samples": 16, "response/length_mean": median + 1.0, "response/length_median": median,
           "response/length_min": low, "response/length_max": high, "response/stop_fraction": 0.0}
    if gpu:
        rec.update({"perf/train_mfu": 0.01 * step, "perf/train_peak_memory_gib": 10.0 + step,
                    "perf/train_device_allocs": 100 * step, "perf/train_alloc_retries": step - 1})
    return rec


def test_summary_has_train_device_figures_and_completion_lengths_where_logged():
    from bench.grpo_arms.ratios import with_ratios
    from bench.grpo_arms.summary import summarise
    lengths = [(900, 100, 3000), (1000, 50, 4096), (1100, 200, 2000), (1200, 300, 2500)]
    gpu = [_record(s, 1000.0 * s, True, lengths[s - 1]) for s in range(1, 5)]
    cpu = [_record(s, 500.0 * s, False, lengths[s - 1]) for s in range(1, 5)]
    on_gpu, on_cpu = summarise(gpu), summarise(cpu)
    # medians over the steps after the first; the spread is the widest of those steps'
    assert on_gpu["train_tokens_per_s"] == 3000.0 and on_gpu["train_mfu"] == pytest.approx(0.03)
    assert on_gpu["train_peak_memory_gib"] == 13.0
    assert on_gpu["train_device_allocs"] == 300 and on_gpu["train_alloc_retries"] == 2
    assert "train_mfu" not in on_cpu and "train_peak_memory_gib" not in on_cpu  # CPU ranks log neither
    assert on_cpu["train_tokens_per_s"] == 1500.0
    assert on_cpu["completion_length_median"] == 1100 and on_cpu["completion_length_mean"] == 1101.0
    assert on_cpu["completion_length_min"] == 50 and on_cpu["completion_length_max"] == 4096
    assert on_cpu["train_tokens_per_s_by_step"] == [500.0, 1000.0, 1500.0, 2000.0]
    result = with_ratios({"rounds": [{"canonical": on_gpu, "stock": on_cpu}, {"canonical": on_cpu, "stock": on_cpu}]})
    first, second = result["rounds"]
    ratio = on_gpu["train_tokens_per_s"] / on_cpu["train_tokens_per_s"]
    assert first["canonical_over_stock_train_tokens_per_s"] == ratio
    assert second["canonical_over_stock_train_tokens_per_s"] == 1.0
    assert result["canonical_over_stock_train_tokens_per_s_median"] == 1.5
    assert "canonical_over_stock_train_tokens_per_s_per_step" not in first  # runs of their own: no step pairs
    paired = with_ratios({"rounds": [{"interleaved": True, "canonical": on_gpu, "stock": on_cpu}]})
    assert paired["rounds"][0]["canonical_over_stock_train_tokens_per_s_per_step"] == [2.0, 2.0, 2.0]
    assert paired["canonical_over_stock_train_tokens_per_s_per_step_median"] == 2.0
    older = {k: v for k, v in on_cpu.items() if not k.startswith("completion_")}  # a summary from before
    assert "canonical_over_stock_train_tokens_per_s" in with_ratios({"rounds": [{"canonical": older,
                                                                                 "stock": older}]})["rounds"][0]


def test_plotted_lengths_are_the_budgets_the_recipe_draws(tmp_path):
    from bench.grpo_arms.lengths import drawn_lengths, length_summary, plot_lengths
    from recipes.config import load_config
    from recipes.rollouts import completion_budget, prompt_indices

    cfg = load_config(REPO / "recipes" / "configs" / "tiny.yaml", [*LOGNORMAL, "train.steps=3"])
    lengths = drawn_lengths(cfg)
    per_step = cfg.train.prompts_per_step
    expected = [completion_budget(0, step, index, j, "lognormal", 12, 6, 0.6) for step in (1, 2, 3)
                for index in prompt_indices((step - 1) * per_step, per_step, 400, 0) for j in range(cfg.rollout.n)]
    assert lengths == expected and len(lengths) == 3 * per_step * cfg.rollout.n
    summary = length_summary(cfg, lengths)
    assert summary["median"] == 6 and summary["max"] <= 12 and summary["cap"] == 12 and summary["count"] == len(lengths)
    title = plot_lengths(cfg, lengths, str(tmp_path / "lengths.png"))
    assert title.startswith("lognormal: median 6, sigma 0.6, cap 12\n")
    assert (tmp_path / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fixed = load_config(REPO / "recipes" / "configs" / "tiny.yaml", ["train.steps=2"])
    assert set(drawn_lengths(fixed)) == {fixed.rollout.max_tokens}
