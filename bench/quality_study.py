"""Does exact zero KL train better? GRPO arms on the same task, model, data order and seeds, several seeds each.

    python -m bench.quality_study --config recipes/configs/tiny.yaml --setting base --seeds 0,1,2 --steps 40 \
        --out ~/zerokl-study [--budget-min 10] [--piece-steps 10] [key.sub=value ...]

Arms (ARMS): `canonical` (zero KL), `stock` (the stock numerics, no correction), `stock_tis` (truncated importance
sampling at cap 2) and `stock_mask` (token-level masking of ratios outside [1/2, 2]); recipes/grpo_loss.py says
what the corrections do. A seed is the recipe's run seed (starting weights, prompt order, sampling seeds), the same
for every arm, so a seed's arms start from the same policy and see the same prompts.

A setting is a name and the overrides that make it (the trailing key=value pairs), recorded with the results;
docs/quality_study.md lists the settings where mismatch is known to bite. Where the config warms the policy up
(`warmup.steps`), each seed is warmed once and saved as a Hugging Face checkpoint in <out>/<setting>/warm-seed<k>/;
every arm of that seed starts from it (`model.source=hf`), so the arms share their first policy bit for bit (a GPU
warm-up run once per arm need not repeat its own bits) and the warm-up's time is spent once per seed. Each run lives in
<out>/<setting>/<arm>-seed<k>/ and advances by at most --piece-steps steps per piece, from its last checkpoint: a
study is a sequence of short invocations, each stopping once --budget-min has passed (the piece running then
finishes first), and the next continues where it stopped. Once every run is done, the summary (JSON on stdout and
in <out>/<setting>/summary.json) and one PNG per quantity (mean and min–max over seeds) are written.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from recipes.checkpoint import find_checkpoint
from recipes.config import load_config
from recipes.metrics import METRICS_FILE, read_metrics

ARMS = {
    "canonical": ["numerics=canonical", "trainer.loss.rollout_correction=none"],
    "stock": ["numerics=stock", "rollout.determinism=off", "trainer.loss.old_logprobs=recompute",
              "trainer.loss.rollout_correction=none"],
    "stock_tis": ["numerics=stock", "rollout.determinism=off", "trainer.loss.old_logprobs=recompute",
                  "trainer.loss.rollout_correction=tis", "trainer.loss.rollout_correction_cap=2"],
    "stock_mask": ["numerics=stock", "rollout.determinism=off", "trainer.loss.old_logprobs=recompute",
                   "trainer.loss.rollout_correction=token_mask", "trainer.loss.rollout_correction_cap=2"],
}
# what the study records at every step (the recipe's metric names) and plots, one PNG each
QUANTITIES = ["reward/mean", "rollout_train/kl", "rollout_train/max_abs_logprob_diff", "train/clip_fraction",
              "train/grad_norm", "train/entropy"]
# MoE policies only: the share of (token, layer) routing decisions the trainer's forward makes as the rollout did
ROUTING = "rollout_train/routing_agreement"


def measured(curves: dict) -> list[str]:
    """QUANTITIES, and the routing agreement where the runs logged it (an MoE policy's)."""
    logged = any(ROUTING in r for by_seed in curves.values() for records in by_seed.values() for r in records)
    return QUANTITIES + ([ROUTING] if logged else [])


def say(message: str) -> None:
    print(f"[quality_study {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def steps_done(run_dir: Path) -> int:
    return len(read_metrics(run_dir)) if (run_dir / METRICS_FILE).is_file() else 0


def latest(run_dir: Path) -> str:
    """The run's last logged step in a few words (the concurrent study's progress lines), or ""."""
    records = read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else []
    if not records:
        return ""
    last = records[-1]
    return (f" (reward {last.get('reward/mean', float('nan')):.3f}, "
            f"max |Δ log-prob| {last.get('rollout_train/max_abs_logprob_diff', float('nan')):.3g})")


def warm_start(config: str, overrides: list[str], seed: int, root: Path) -> list[str]:
    """The overrides that start seed `seed`'s runs from its warmed policy, saved once in root/warm-seed<seed>/ (the
    run's own warm-up: recipes.grpo_job.starting_model); none where the config has no warm-up."""
    cfg = load_config(config, [*overrides, f"seed={seed}"])
    if cfg.warmup.steps <= 0:
        return []
    path = root / f"warm-seed{seed}"
    if not (path / "config.json").is_file():
        from recipes.grpo_job import starting_model
        from recipes.task import build_task
        say(f"seed {seed}: warming the policy up ({cfg.warmup.steps} steps on {cfg.warmup.device})")
        model = starting_model(cfg, build_task(cfg), resumed=False)
        partial = path.with_name(path.name + ".partial")  # renamed when whole: a killed save is not taken
        model.save_pretrained(partial)
        partial.rename(path)
    return ["model.source=hf", f"model.name={path}", "warmup.steps=0"]


def run_piece(config: str, arm: str, seed: int, overrides: list[str], run_dir: Path, steps: int,
              piece_steps: int) -> int:
    """Advance one run by up to piece_steps steps (from its last checkpoint, if it has one); its step count after."""
    from recipes.grpo_job import run
    from rollout_service.service.ray_cluster import init_ray
    init_ray()  # once, at the first piece: a study with nothing left to run needs no Ray
    done = steps_done(run_dir)
    until = min(steps, done + piece_steps)
    try:
        resume = find_checkpoint(run_dir) if done else None
    except FileNotFoundError:  # no complete checkpoint yet: the piece starts the run again
        resume = None
    pieces = [*overrides, *ARMS[arm], f"seed={seed}", f"train.steps={until}", "train.save_final=true"]
    cfg = load_config(config, pieces)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    say(f"{arm} seed {seed}: steps {done + 1 if resume else 1}..{until} of {steps}")
    with contextlib.redirect_stdout(sys.stderr):  # the run's step lines are progress; stdout is the JSON
        run(cfg, resume=resume, progress=False)
    return steps_done(run_dir)


def paired_differences(curves: dict, arm: str, key: str, windows: int = 4) -> list[dict]:
    """The canonical arm minus `arm` on `key`, seed by seed (same seed, same start and prompts), averaged over
    each of `windows` consecutive step windows: its mean and min..max over seeds, and the number of seeds where
    canonical is ahead (difference > 0) and behind (< 0)."""
    seeds = sorted(set(curves["canonical"]) & set(curves[arm]))
    steps = min(len(curves[a][s]) for a in ("canonical", arm) for s in seeds)
    size = max(steps // windows, 1)
    out = []
    for lo in range(0, steps - size + 1, size):
        diffs = [statistics.fmean(r[key] for r in curves["canonical"][s][lo:lo + size])
                 - statistics.fmean(r[key] for r in curves[arm][s][lo:lo + size]) for s in seeds]
        # with a handful of seeds, how many point each way says more than the mean alone
        out.append({"steps": [lo + 1, lo + size], "mean": statistics.fmean(diffs), "min": min(diffs),
                    "max": max(diffs), "seeds": len(diffs), "ahead": sum(d > 0 for d in diffs),
                    "behind": sum(d < 0 for d in diffs)})
    return out


def summarize(curves: dict, setting: str, overrides: list[str]) -> dict:
    """Per arm and quantity: the last quarter's mean over steps, as mean and min..max over seeds; and the canonical
    arm's reward against each other arm, paired by seed, per quarter of the run and over the whole run."""
    arms = {}
    for arm, by_seed in curves.items():
        arms[arm] = {}
        for key in measured(curves):
            finals = []
            for records in by_seed.values():
                tail = records[-max(len(records) // 4, 1):]
                values = [r[key] for r in tail if key in r]
                if values:
                    finals.append(statistics.fmean(values))
            if finals:
                arms[arm][key] = {"last_quarter_mean": statistics.fmean(finals), "min": min(finals),
                                  "max": max(finals), "seeds": len(finals)}
    others = [arm for arm in curves if arm != "canonical" and "canonical" in curves]
    return {"setting": setting, "overrides": overrides, "arms": arms,
            "canonical_minus_arm_reward": {arm: paired_differences(curves, arm, "reward/mean") for arm in others},
            "canonical_minus_arm_reward_whole_run": {arm: paired_differences(curves, arm, "reward/mean", windows=1)[0]
                                                     for arm in others}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="recipes/configs/tiny.yaml")
    ap.add_argument("--setting", default="base", help="the setting's name (its overrides are the key=value pairs)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--piece-steps", type=int, default=10, help="steps a run advances by per piece (each ends with a checkpoint)")
    ap.add_argument("--budget-min", type=float, default=None, help="start no piece after this many minutes")
    ap.add_argument("--out", required=True, help="the study's directory (runs, summary, plots)")
    ap.add_argument("--concurrent", type=int, default=1,
                    help="runs advanced at once, each in a process of its own (bench/quality_concurrent.py)")
    ap.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)  # a --concurrent study's child
    ap.add_argument("overrides", nargs="*", help="the setting: key.sub=value overrides of --config")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.steps < 1 or args.piece_steps < 1 or args.concurrent < 1:
        ap.error("--steps, --piece-steps and --concurrent must be >= 1")
    root = Path(args.out).expanduser().resolve() / args.setting
    root.mkdir(parents=True, exist_ok=True)
    for arm in arms:  # every arm's config is checked before any run starts
        load_config(args.config, [*args.overrides, *ARMS[arm]])

    start = time.monotonic()
    runs = [(arm, seed) for seed in seeds for arm in arms]  # seed-major: a stopped study has whole seeds
    if args.concurrent > 1:
        _run_in_children(args, runs, root, start)
    while True:
        pending = [(a, s) for a, s in runs if steps_done(root / f"{a}-seed{s}") < args.steps]
        if not pending:
            break
        if args.budget_min is not None and time.monotonic() - start > 60 * args.budget_min:
            say(f"budget of {args.budget_min:g} min spent; {len(pending)} runs not done: run the same command again")
            return {"done": False, "pending": [f"{a}-seed{s}" for a, s in pending]}
        arm, seed = pending[0]
        start_from = warm_start(args.config, args.overrides, seed, root)
        run_piece(args.config, arm, seed, [*args.overrides, *start_from], root / f"{arm}-seed{seed}", args.steps,
                  args.piece_steps)

    if args.one_run:  # the parent study summarises
        return {"done": True}
    curves = {arm: {seed: read_metrics(root / f"{arm}-seed{seed}")[:args.steps] for seed in seeds} for arm in arms}
    summary = {"done": True, "config": args.config, "steps": args.steps, "seeds": seeds,
               **summarize(curves, args.setting, args.overrides)}
    from bench.quality_plot import plot_quantities, plot_reward_gaps
    plots = plot_quantities(curves, measured(curves), root / "plots", args.setting)
    if "canonical" in curves and len(curves) > 1:
        plots.append(plot_reward_gaps(curves, root / "plots", args.setting))
    summary["plots"] = [str(p) for p in plots]
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


def _run_in_children(args, runs: list[tuple[str, int]], root: Path, start: float) -> None:
    """--concurrent: the pending runs advanced by child processes, up to args.concurrent at once, within the
    budget; raises SystemExit naming the runs whose child failed, once the others have stopped."""
    from bench.quality_concurrent import run_concurrently

    def child_argv(arm: str, seed: int, minutes: float | None) -> list[str]:
        argv = [sys.executable, "-m", "bench.quality_study", "--one-run", "--config", args.config, "--setting",
                args.setting, "--arms", arm, "--seeds", str(seed), "--steps", str(args.steps), "--piece-steps",
                str(args.piece_steps), "--out", args.out]
        return argv + (["--budget-min", f"{minutes:.4f}"] if minutes is not None else []) + args.overrides

    pending = [(a, s) for a, s in runs if steps_done(root / f"{a}-seed{s}") < args.steps]
    deadline = None if args.budget_min is None else start + 60 * args.budget_min
    needs_warmup = load_config(args.config, args.overrides).warmup.steps > 0
    failed = run_concurrently(pending, args.concurrent, child_argv, root, needs_warmup, args.steps, deadline,
                              steps_done, latest, say)
    if failed:
        raise SystemExit("quality study: these runs failed (the others kept their steps; run the same command "
                         "again to continue): " + "; ".join(failed))


if __name__ == "__main__":
    main()
