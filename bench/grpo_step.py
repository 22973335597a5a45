"""GRPO step time, zero KL against the stock arm, on the same data, model, batch and optimizer; JSON.

    python -m bench.grpo_step --config recipes/configs/gpu_colocated.yaml --steps 11 --rounds 2
    python -m bench.grpo_step --config recipes/configs/gpu_split.yaml --steps 11
    python -m bench.grpo_step --steps 3 --rounds 1 --device cpu          # a smoke run of the tiny config
    python -m bench.grpo_step ... --arms canonical > a.json; ... --arms stock > b.json
    python -m bench.grpo_step --merge a.json b.json                      # one arm per call, joined
    python -m bench.grpo_step --config recipes/configs/gpu_colocated.yaml --steps 21 --interleave
    python -m bench.grpo_step --config recipes/configs/gpu_colocated.yaml --steps 6 --interleave \
        --plot-lengths lengths.png warmup.steps=0 train.prompts_per_step=64 model.max_positions=8192 \
        rollout.length_distribution=lognormal rollout.length_median=1024 rollout.max_tokens=4096 \
        trainer.max_tokens_per_micro_batch=16384 trainer.activation_checkpointing=true

Each round runs the recipe once per arm, taking turns (these machines are noisy), in the order given
in even rounds and in the reverse order in odd ones (`order` in each round): on GPUs the arm that
ran second was seen to run faster, so an even number of rounds pairs both orders. `canonical` (the
config as it is, KL 0) and `stock` (numerics=stock: the stock engine's rollouts, the unpatched model
under FSDP2 with SDPA, old log-probs recomputed, right-padded rows within the config's token budget and
activation checkpointing; see ARMS); `--arms canonical,async` adds `async` (train.async_steps=1:
the next step's rollouts generated while the trainer steps; split placement) and `async-in-flight` (the
same, its pushes landing in the rollouts in flight: native engines, object store). Per arm and round:
the median over the steps after the first (compiles, warm caches) of rollout, train, weight sync,
engine sleep and step seconds (checkpoint writes left out), rollout and train tokens/s, the
trainer's MFU and peak memory (GPU ranks only), the completions' median length and its spread, and
the largest KL and max |Δ log-prob| of any step; per round the paired ratios stock step / canonical
step (above 1: zero KL is faster), canonical / stock train tokens/s, and canonical step / async step
(the asynchronous speed-up), the same pairs of the steps after the first summed (`*_steps_summed`:
slow steps count there), and samples per second; per round, for the async arms, the seconds of steps
each arm took to reach the same reward (time_to_reward). Progress goes to stderr, the JSON to stdout;
--plot draws the split.

Completion lengths: rollout.length_distribution=lognormal gives each request its own max_tokens, drawn
as the recipe draws it (recipes.rollouts.completion_budget: median rollout.length_median, log-space
std rollout.length_sigma, capped at rollout.max_tokens). These benchmarks' random models almost
never emit EOS, so their completions run to the drawn budget, with one exception: the supervised
warm-up teaches the arithmetic answer and its EOS (about 3 tokens), hence warmup.steps=0 above.
--plot-lengths draws a histogram of the budgets the config draws for its steps (and puts their
summary in the JSON as `drawn_lengths`) before the runs start.

--interleave runs the arms' jobs side by side in this process, on the same GPUs, taking steps in turns
(step k of each arm, their order alternating from step to step), so that a machine that slows for
minutes slows both arms alike; each actor's resource share is halved for it. Each round then also has
the paired ratio of every step after the first (`*_per_step`) and its median. Only synchronous arms:
an async arm generates between its steps, into the other arm's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from recipes.config import RecipeConfig, load_config
from recipes.metrics import STEP_PARTS, read_metrics, step_medians

# The stock arm pads its rows within the same token budget: transformers' padding-free path over SDPA builds a
# dense block-diagonal mask per packed row, and its train step measured 0.55x its padded one's speed on an
# H200 (flash-attn's varlen kernels, its fast padding-free path, are not installed there).
ARMS = {"canonical": [], "stock": ["numerics=stock", "rollout.determinism=off", "trainer.old_logprobs=recompute",
                                   "trainer.packing=false"],
        "async": ["train.async_steps=1"],
        "async-in-flight": ["train.async_steps=1", "trainer.weight_switch=switch-in-flight",
                            "trainer.weight_sync=object_store"]}
# (numerator arm, denominator arm) of each paired ratio of step times, per round
RATIOS = {"stock_over_canonical_step": ("stock", "canonical"),
          "canonical_over_async_step": ("canonical", "async"),
          "canonical_over_async_in_flight_step": ("canonical", "async-in-flight")}
# (numerator arm, denominator arm) of each paired ratio of train tokens/s, per round (above 1: the
# numerator's trainer is faster)
TOKEN_RATIOS = {"canonical_over_stock_train_tokens_per_s": ("canonical", "stock")}
# the trainer's device figures (recipes.metrics.train_device_metrics): logged by GPU ranks only
DEVICE_FIGURES = {"train_mfu": "perf/train_mfu", "train_peak_memory_gib": "perf/train_peak_memory_gib"}
REWARD_WINDOW = 3  # steps in the trailing mean that time-to-reward compares (rewards are noisy step to step)
CPU_SMOKE = ["warmup.steps=10", "train.prompts_per_step=8", "metrics.wandb=false"]


def arm_overrides(arm: str, steps: int, extra: list[str]) -> list[str]:
    return [f"train.steps={steps}", "train.save_every=0", "train.save_final=false", "metrics.wandb=false",
            *ARMS[arm], *extra]


def run_arm(config: str, arm: str, steps: int, extra: list[str], run_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "recipes.grpo", "--config", config, "--no-progress", "--run-dir", str(run_dir),
           *arm_overrides(arm, steps, extra)]
    print(f"[bench] {arm}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return read_metrics(run_dir)


def half_shares(config: str, overrides: list[str]) -> list[str]:
    """Overrides that halve the workers' and ranks' CPU and GPU shares, so that two jobs fit where one
    did. Ray's shares place the actors; the CPU share also sets OMP_NUM_THREADS in them (Ray's
    default), which the ranks override with trainer.torch_threads."""
    cfg = load_config(config, overrides)
    out = []
    for key, options in (("rollout.resources_per_worker", cfg.rollout.resources_per_worker),
                         ("trainer.resources_per_rank", cfg.trainer.resources_per_rank)):
        for resource in ("num_cpus", "num_gpus"):
            if options.get(resource):
                out.append(f"{key}.{resource}={options[resource] / 2}")
    return out


def run_interleaved(config: str, arms: list[str], steps: int, extra: list[str], tmp: Path):
    """The arms' jobs side by side in this process (one Ray session), taking steps in turns: step k of
    each arm, in the given order at odd k and reversed at even k. Each job's step is timed by the
    recipe as in a run of its own; the other job is idle meanwhile (synchronous arms only). Returns
    each arm's step records, and the GPUs Ray gave its workers and ranks.

    Rule: both jobs take half of each bundle of one placement group, reserved as one job's would be:
    the arms' workers share their GPUs, as do their ranks, and a split job's worker is never on its
    rank's GPU (Ray packs two half shares onto one GPU when no bundle keeps them apart, which would
    make a split arm a colocated one whose weights go by CUDA IPC)."""
    from recipes.grpo import GRPOJob, reserve_placement
    from rollout_service.service.ray_cluster import init_ray, release
    started = init_ray()
    jobs, steppers, records = {}, {}, {arm: [] for arm in arms}
    group = None
    with contextlib.redirect_stdout(sys.stderr):  # the jobs' progress lines: stdout is the JSON's
        try:
            one_job = load_config(config, arm_overrides(arms[0], steps, extra))  # at one job's whole shares
            group = reserve_placement(one_job)
            for arm in arms:
                overrides = arm_overrides(arm, steps, extra)
                overrides += half_shares(config, overrides) + [f"run_dir={tmp / arm}"]
                print(f"[bench] {arm}, interleaved: {' '.join(overrides)}", flush=True)
                jobs[arm] = GRPOJob(load_config(config, overrides), placement_group=group)
                steppers[arm] = jobs[arm].steps(progress=False)
            for k in range(1, steps + 1):
                for arm in (arms if k % 2 else arms[::-1]):
                    records[arm].append(next(steppers[arm]))
                    print(f"[bench] {arm} step {k}: {records[arm][-1]['perf/step_s']:.3f}s", flush=True)
                if k == 1:
                    check_split_gpus(one_job.placement, {arm: job.gpus for arm, job in jobs.items()})
            for arm in arms:  # past the last step: the job lands its last push and tears down
                extra_step = next(steppers[arm], None)
                if extra_step is not None:
                    raise RuntimeError(f"{arm}: a step past train.steps={steps}: {extra_step['step']}")
        finally:
            for stepper in steppers.values():
                stepper.close()
            if group is not None and not started:
                release(group)
            if started:  # its workers' last log lines before the JSON, not into it
                import ray
                ray.shutdown()
    return records, {arm: job.gpus for arm, job in jobs.items()}


def check_split_gpus(placement: str, gpus: dict[str, dict[str, list[str]]]) -> None:
    """Refuses a split arm whose rollout workers and trainer ranks share a GPU (`gpus`: each arm's
    GRPOJob.gpus): its step would not be a split step."""
    if placement != "split":
        return
    for arm, where in gpus.items():
        both = sorted(set(where["rollout"]) & set(where["trainer"]))
        if both:
            raise RuntimeError(f"{arm}: split placement, but its rollout workers and trainer ranks share GPUs "
                               f"{both} (rollout {where['rollout']}, trainer {where['trainer']})")


def summarise(records: list[dict]) -> dict:
    steady = records[1:] or records
    out = {f"{part}_s": seconds for part, seconds in step_medians(records).items()}
    out["rollout_tokens_per_s"] = statistics.median(r["perf/rollout_tokens_per_s"] for r in steady)
    out["train_tokens_per_s"] = statistics.median(r["perf/train_tokens_per_s"] for r in steady)
    out["train_tokens_per_s_by_step"] = [r["perf/train_tokens_per_s"] for r in records]
    for name, key in DEVICE_FIGURES.items():
        values = [r[key] for r in steady if key in r]
        if values:
            out[name] = statistics.median(values)
    if all("response/length_median" in r for r in steady):  # generated tokens per rollout
        out["completion_length_median"] = statistics.median(r["response/length_median"] for r in steady)
        out["completion_length_mean"] = statistics.median(r["response/length_mean"] for r in steady)
        out["completion_length_min"] = min(r["response/length_min"] for r in steady)
        out["completion_length_max"] = max(r["response/length_max"] for r in steady)
        out["stop_fraction"] = statistics.median(r["response/stop_fraction"] for r in steady)
    out["sync_share"] = out["weight_sync_s"] / out["step_s"]
    phases = sorted({k for r in steady for k in r if k.startswith("perf/sync_")})  # where the sync went
    out["sync_phases_s"] = {k[len("perf/sync_"):-2]: statistics.median(r.get(k, 0.0) for r in steady) for k in phases}
    out["max_kl"] = max(abs(r["rollout_train/kl"]) for r in records)
    out["max_abs_logprob_diff"] = max(r["rollout_train/max_abs_logprob_diff"] for r in records)
    out["reward_first_last"] = [records[0]["reward/mean"], records[-1]["reward/mean"]]
    out["steps"] = len(records)
    seconds = [r["perf/step_s"] - r.get("perf/checkpoint_s", 0.0) for r in records]
    out["samples_per_s"] = statistics.median(r["rollout/samples"] / s for r, s in zip(steady, seconds[-len(steady):]))
    # seconds of the steps after the first (it compiles and warms caches, as in the medians) up to each step
    elapsed = [sum(seconds[1:i + 1]) for i in range(len(seconds))]
    out["reward_curve"] = [[round(t, 4), r["reward/mean"]] for t, r in zip(elapsed, records)]
    out["step_seconds"] = seconds
    # all of them, summed: a few slow steps (a new shape compiled) move it, and not the median
    out["steps_after_first_s"] = elapsed[-1]
    return out


def smoothed(curve: list[list[float]], width: int = REWARD_WINDOW) -> list[tuple[float, float]]:
    """(elapsed seconds, mean reward of the last `width` steps) from each step on where there are `width`."""
    return [(curve[i][0], statistics.fmean(r for _, r in curve[i + 1 - width:i + 1]))
            for i in range(width - 1, len(curve))]


def time_to_reward(row: dict, arms: tuple[str, str]) -> dict | None:
    """Seconds of steps each arm took to reach the same reward: the lower of the two arms' last smoothed
    reward (both reached it), as the first step where an arm's smoothed reward is at or above it."""
    if not all(a in row and len(row[a].get("reward_curve", [])) >= REWARD_WINDOW for a in arms):
        return None
    curves = {a: smoothed(row[a]["reward_curve"]) for a in arms}
    target = min(c[-1][1] for c in curves.values())
    reached = {a: next(t for t, r in c if r >= target) for a, c in curves.items()}
    return {"target_reward": target, **{f"{a}_s": reached[a] for a in arms},
            f"{arms[0]}_over_{arms[1]}": reached[arms[0]] / reached[arms[1]]}


def with_ratios(result: dict) -> dict:
    """Each round's RATIOS where it has both arms, and their medians."""
    for row in result["rounds"]:
        for num, den in (pair for pair in RATIOS.values() if pair[1].startswith("async")):
            reached = time_to_reward(row, (num, den))
            if reached is not None:
                row[f"time_to_reward_{num}_vs_{den}"] = reached
    for name, (num, den) in RATIOS.items():
        summed = name.removesuffix("_step") + "_steps_summed"  # the same pair, of steps_after_first_s
        # interleaved rounds: step k of one arm against step k of the other
        per_step = name.removesuffix("_step") + "_per_step"
        for row in result["rounds"]:
            if num in row and den in row:
                row[name] = row[num]["step_s"] / row[den]["step_s"]
                if "steps_after_first_s" in row[num] and "steps_after_first_s" in row[den]:
                    row[summed] = row[num]["steps_after_first_s"] / row[den]["steps_after_first_s"]
                if row.get("interleaved"):
                    row[per_step] = [n / d for n, d in zip(row[num]["step_seconds"][1:], row[den]["step_seconds"][1:])]
                    row[f"{per_step}_median"] = statistics.median(row[per_step])
        for key in (name, summed):
            ratios = [r[key] for r in result["rounds"] if key in r]
            if ratios:
                result[f"{key}_median"] = statistics.median(ratios)
        pooled = [ratio for r in result["rounds"] for ratio in r.get(per_step, [])]
        if pooled:  # every round's steps
            result[f"{per_step}_median"] = statistics.median(pooled)
    for name, (num, den) in TOKEN_RATIOS.items():
        per_step = f"{name}_per_step"
        for row in result["rounds"]:
            if "train_tokens_per_s" in row.get(num, {}) and "train_tokens_per_s" in row.get(den, {}):
                row[name] = row[num]["train_tokens_per_s"] / row[den]["train_tokens_per_s"]
                if row.get("interleaved"):
                    row[per_step] = [n / d for n, d in zip(row[num]["train_tokens_per_s_by_step"][1:],
                                                           row[den]["train_tokens_per_s_by_step"][1:])]
        ratios = [r[name] for r in result["rounds"] if name in r]
        if ratios:
            result[f"{name}_median"] = statistics.median(ratios)
        pooled = [ratio for r in result["rounds"] for ratio in r.get(per_step, [])]
        if pooled:
            result[f"{per_step}_median"] = statistics.median(pooled)
    return result


def drawn_lengths(cfg: RecipeConfig) -> list[int]:
    """The max_tokens of every request a new run of `cfg` sends in its train.steps steps, drawn by the
    recipe's own functions (the task's prompt order, recipes.rollouts.group_requests)."""
    from recipes.rollouts import group_requests, prompt_indices
    from recipes.task import build_task
    task = build_task(cfg)
    per_step = cfg.train.prompts_per_step
    lengths = []
    for step in range(1, cfg.train.steps + 1):
        indices = prompt_indices((step - 1) * per_step, per_step, len(task.dataset), cfg.seed)
        _, params = group_requests([task.dataset[i]["prompt_ids"] for i in indices], indices, step, cfg.rollout,
                                   cfg.seed, task.stop_token_ids)
        lengths += [p.max_tokens for p in params]
    return lengths


def length_summary(cfg: RecipeConfig, lengths: list[int]) -> dict:
    r = cfg.rollout
    return {"distribution": r.length_distribution, "median_set": r.length_median, "sigma": r.length_sigma,
            "cap": r.max_tokens, "steps": cfg.train.steps, "count": len(lengths),
            "median": statistics.median(lengths), "min": min(lengths), "max": max(lengths),
            "at_cap": sum(n == r.max_tokens for n in lengths) / len(lengths)}


def plot_lengths(cfg: RecipeConfig, lengths: list[int], path: str) -> str:
    """A histogram of drawn completion budgets; returns its title, which states the distribution and its
    parameters."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    r, summary = cfg.rollout, length_summary(cfg, lengths)
    if r.length_distribution == "lognormal":
        law = f"lognormal: median {r.length_median}, sigma {r.length_sigma:g}, cap {r.max_tokens}"
    else:
        law = f"fixed: every request {r.max_tokens}"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=min(60, max(1, len(set(lengths)))), color="tab:blue")
    ax.axvline(summary["median"], color="black", linestyle="--", label=f"median drawn {summary['median']:g}")
    ax.set_xlabel("completion budget (max_tokens), tokens")
    ax.set_ylabel("requests")
    title = (f"{law}\n{len(lengths)} requests over {cfg.train.steps} steps "
             f"({cfg.train.prompts_per_step} prompts x {r.n}); {summary['at_cap']:.1%} at the cap")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return title


def merge(parts: list[dict]) -> dict:
    """Outputs of runs with other arms (--arms), joined round by round; they must share config, steps
    and overrides, and no arm may appear twice in a round."""
    keys = {(p["config"], p["steps"], tuple(p["overrides"])) for p in parts}
    if len(keys) != 1:
        raise ValueError(f"--merge: the runs differ in config, steps or overrides: {sorted(keys)}")
    result = {k: parts[0][k] for k in ("config", "steps", "overrides")}
    result["rounds"] = []
    for i in range(max(len(p["rounds"]) for p in parts)):
        row = {}
        for p in parts:
            for arm, figures in (p["rounds"][i] if i < len(p["rounds"]) else {}).items():
                if arm not in ARMS:
                    continue
                if arm in row:
                    raise ValueError(f"--merge: arm {arm!r} appears twice in round {i}")
                row[arm] = figures
        result["rounds"].append(row)
    return with_ratios(result)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rounds = result["rounds"]
    labels = [f"{arm} r{i}" for i, r in enumerate(rounds) for arm in r if arm in ARMS]
    curves = [(f"{arm} r{i}", r[arm]["reward_curve"]) for i, r in enumerate(rounds) for arm in r
              if arm in ARMS and "reward_curve" in r[arm]]
    # interleaved rounds: each arm's step seconds, step by step (the pairs the per-step ratios divide)
    turns = [(f"{arm} r{i}", r[arm]["step_seconds"]) for i, r in enumerate(rounds) if r.get("interleaved")
             for arm in r["order"]]
    panels = 1 + bool(curves) + bool(turns)
    fig, axes = plt.subplots(1, panels, figsize=(1.6 * len(labels) + 2 + 6 * (panels - 1), 4), squeeze=False)
    ax = axes[0][0]
    bottom = [0.0] * len(labels)
    for part in STEP_PARTS:
        vals = [r[arm][f"{part}_s"] for r in rounds for arm in r if arm in ARMS]
        ax.bar(labels, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    rest = [r[arm]["step_s"] - b for (r, arm), b in zip([(r, a) for r in rounds for a in r if a in ARMS], bottom)]
    ax.bar(labels, rest, bottom=bottom, label="other")
    ax.set_ylabel("seconds per GRPO step (median)")
    ax.set_title(f"{result['config']}: step split per arm")
    ax.legend()
    if curves:  # reward against the seconds of steps after the first: time to the same reward
        ax = axes[0][1]
        for label, curve in curves:
            points = smoothed(curve)
            ax.plot([t for t, _ in points], [r for _, r in points], marker="o", label=label)
        ax.set_xlabel("seconds of steps after the first")
        ax.set_ylabel(f"reward, mean of the last {REWARD_WINDOW} steps")
        ax.legend()
    if turns:
        ax = axes[0][-1]
        for label, seconds in turns:
            ax.plot(range(1, len(seconds) + 1), seconds, marker="o", label=label)
        ax.set_xlabel("step (the arms in turns)")
        ax.set_ylabel("step seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="recipes/configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=11, help="per run; the first is left out of the medians")
    ap.add_argument("--rounds", type=int, default=1, help="odd rounds run the arms in reverse order")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the tiny config, a smoke run")
    ap.add_argument("--plot", default=None, help="a PNG of each arm's step split")
    ap.add_argument("--arms", default="canonical,stock",
                    help=f"the arms to run, in this order (one per call when a call's time is capped); of "
                         f"{', '.join(ARMS)}")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no runs: join earlier outputs of this benchmark (one arm each, the same config "
                         "and machine, run in turns) round by round, with their ratios")
    ap.add_argument("--interleave", action="store_true",
                    help="the arms side by side on the same GPUs, taking steps in turns (synchronous arms only)")
    ap.add_argument("--plot-lengths", default=None, metavar="PNG",
                    help="a histogram of the completion budgets (max_tokens) the config draws for its steps")
    ap.add_argument("overrides", nargs="*", help="key.sub=value, given to both arms")
    args = ap.parse_args()
    if args.merge and args.plot_lengths:
        ap.error("--plot-lengths draws a run's lengths: give it without --merge")
    if args.merge:
        result = merge([json.loads(Path(p).read_text()) for p in args.merge])
    else:
        arms = args.arms.split(",")
        unknown = sorted(set(arms) - set(ARMS))
        if unknown:
            ap.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
        if args.interleave and any(a.startswith("async") for a in arms):
            ap.error("--interleave: an async arm generates between its steps, into the other arm's; "
                     "run it without --interleave")
        extra = (CPU_SMOKE if args.device == "cpu" else []) + args.overrides
        result = {"config": args.config, "steps": args.steps, "overrides": args.overrides, "rounds": []}
        if args.plot_lengths:  # before the runs: the lengths are the config's, whatever the runs do
            cfg = load_config(args.config, arm_overrides(arms[0], args.steps, extra))
            lengths = drawn_lengths(cfg)
            plot_lengths(cfg, lengths, args.plot_lengths)
            result["drawn_lengths"] = length_summary(cfg, lengths)
        with tempfile.TemporaryDirectory(prefix="zerokl-bench-grpo-") as tmp:
            for i in range(args.rounds):
                order = arms if i % 2 == 0 else arms[::-1]
                row = {"order": order}
                if args.interleave:
                    records, gpus = run_interleaved(args.config, order, args.steps, extra, Path(tmp) / f"round-{i}")
                    row.update({"interleaved": True,
                                **{arm: {**summarise(records[arm]), "gpus": gpus[arm]} for arm in order}})
                else:
                    for arm in order:
                        row[arm] = summarise(run_arm(args.config, arm, args.steps, extra, Path(tmp) / f"{arm}-{i}"))
                        # each arm's figures as soon as it ends: a later arm that fails does not lose them
                        print(f"[bench] {arm} round {i}: {json.dumps(row[arm])}", file=sys.stderr, flush=True)
                result["rounds"].append(row)
        with_ratios(result)
    print(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
