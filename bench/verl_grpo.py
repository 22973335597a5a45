"""verl's GSM8K GRPO with the zero-KL integration against verl as users run it: time per step, arms in turns.

    python -m bench.verl_grpo --shape quickstart|qwen1.5b|tiny [--prompts N] [--steps 4] [--rounds 2] [--gsm8k DIR]
                              [--arms verl,zerokl] [--out FILE [--runs N]]

Arms, each one `python -m verl.trainer.main_ppo` process on the same model, data and settings:
- `verl`: verl's default: vLLM rollout, use_remove_padding, the old log-probs recomputed by the actor;
- `verl-padded` (not run unless named): the same with use_remove_padding=false. verl's packed path is written for
  flash-attn; where flash-attn is not installed (no wheel is published for every torch and CUDA), verl's actor
  runs transformers' SDPA on packed rows (on an H200 without flash-attn the two paths took about the same time
  per prompt);
- `zerokl`: `actor_rollout_ref.model.external_lib` names the integration, and
  `algorithm.rollout_correction.bypass_mode=true` takes the rollout's log-probs as the old log-probs (their bits
  are the actor's, so the recompute pass is skipped).

Round r starts with arm r mod 2, so the machine's drift falls on both alike. Per arm and round: verl's
`timing_s/*` of every step (step, gen, old_log_prob, ref, update_actor, update_weights, ...) and
`training/rollout_probs_diff_max` where verl logs it (not in bypass mode, which computes no second log-prob).
The ratio is verl's step over zerokl's, per round, of the median step after the first (compiles and warm-up).

The model is random weights of the shape with a byte-level tokenizer of 259 ids; the embedding is wider, as
Qwen2.5's is, so verl's vLLM-only vocabulary mask is exercised. Sampling among the tokenizer's 259 ids, the random
model ends at EOS at varied lengths, capped at data.max_response_length (the JSON keeps each step's mean response
length: 152-165 of 256 tokens at the quick start's shapes, 307-352 of 512 at qwen1.5b's). GSM8K rows come from
--gsm8k (train.jsonl / test.jsonl), converted to parquet as verl's examples/data_preprocess/gsm8k.py converts them.
The GPU test tests/gpu/test_verl_quickstart_gpu.py runs the same quick start for log-prob bits. Progress goes to
stderr; one JSON document to stdout (and --out); each verl process's output goes to a log in --workdir.
bench.verl_plot draws documents' step splits as a PNG.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import emit, write_doc  # noqa: E402
from rollout_service.integrations.verl import LIB  # noqa: E402
ARMS = ("verl", "verl-padded", "zerokl")
DEFAULT_ARMS = ("verl", "zerokl")
STOCK_ARMS = ("verl", "verl-padded")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DIFF_KEY = "training/rollout_probs_diff_max"


@dataclass(frozen=True)
class Shape:
    """A model (tiny_model's keyword arguments) and verl's batch settings for it."""
    model: dict
    train_batch_size: int  # prompts a step
    n: int  # rollouts a prompt
    max_prompt_length: int
    max_response_length: int
    ppo_mini_batch_size: int  # prompts an optimizer step
    micro_batch_size_per_gpu: int  # sequences a forward (actor update, old and reference log-probs)
    gpu_memory_utilization: float
    lr: float


SHAPES = {
    # the GPU test's: 2 layers, a few seconds a step
    "tiny": Shape(dict(vocab_size=320, hidden_size=256, intermediate_size=768, num_heads=8, num_kv_heads=2,
                       num_layers=2, max_positions=2048), 8, 4, 512, 64, 8, 4, 0.3, 1e-4),
    # verl's quick start (docs/start/quickstart: Qwen2.5-0.5B-Instruct, 256 prompts, 512 + 256 tokens,
    # mini-batches of 64), with GRPO's 5 rollouts a prompt as verl's GRPO examples sample
    "quickstart": Shape(dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_heads=14,
                             num_kv_heads=2, num_layers=24, max_positions=2048), 256, 5, 512, 256, 64, 16, 0.4, 1e-6),
    # Qwen2.5-1.5B shapes with 512-token completions
    "qwen1.5b": Shape(dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_heads=12,
                           num_kv_heads=2, num_layers=28, max_positions=2048), 64, 8, 512, 512, 32, 8, 0.4, 1e-6),
}


def gsm8k_parquet(source: Path, out: Path, rows: dict[str, int]) -> dict[str, str]:
    """train/test parquet files in verl's GSM8K layout (prompt as chat messages, the answer after '####' as the
    rule reward's ground truth, data_source 'openai/gsm8k' so verl's default reward picks its GSM8K scorer)."""
    import datasets
    paths = {}
    for split, count in rows.items():
        records = []
        with open(source / f"{split}.jsonl") as f:
            for index, line in zip(range(count), f):
                example = json.loads(line)
                answer = re.search(r"#### (\-?[0-9\.\,]+)", example["answer"]).group(1).replace(",", "")
                records.append({
                    "data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": example["question"] + " " + INSTRUCTION}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": answer},
                    "extra_info": {"split": split, "index": index, "answer": example["answer"],
                                   "question": example["question"]},
                })
        if len(records) < count:
            raise ValueError(f"{source / f'{split}.jsonl'} has {len(records)} rows, {count} asked for")
        paths[split] = str(out / f"{split}.parquet")
        datasets.Dataset.from_list(records).to_parquet(paths[split])
    return paths


def byte_level_checkpoint(path: Path, model_kw: dict) -> str:
    """A random Qwen2 of `model_kw` with the byte-level tokenizer (259 ids, a chat template), saved to `path`."""
    from rollout_service.tiny_models import byte_level_tokenizer, tiny_model
    tokenizer = byte_level_tokenizer()
    if len(tokenizer) >= model_kw["vocab_size"]:
        raise ValueError(f"vocab_size {model_kw['vocab_size']} must exceed the tokenizer's {len(tokenizer)} ids")
    model = tiny_model("qwen2", seed=7, **model_kw)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def verl_overrides(shape: Shape, model: str, data: dict[str, str], steps: int, arm: str, name: str) -> list[str]:
    """verl.trainer.main_ppo's command-line overrides for one arm: the GRPO quick start's settings at `shape`;
    zerokl adds the integration and bypass mode."""
    s = shape
    overrides = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data['train']}", f"data.val_files={data['test']}",
        f"data.train_batch_size={s.train_batch_size}", f"data.max_prompt_length={s.max_prompt_length}",
        f"data.max_response_length={s.max_response_length}",
        "data.filter_overlong_prompts=True", "data.truncation=error",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.model.use_remove_padding={arm != 'verl-padded'}",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={s.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={s.ppo_mini_batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={s.micro_batch_size_per_gpu}",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={s.n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={s.gpu_memory_utilization}",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={s.micro_batch_size_per_gpu}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={s.micro_batch_size_per_gpu}",
        "trainer.logger=[console,file]", "trainer.project_name=zerokl", f"trainer.experiment_name={name}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={steps}",
        "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False",
        # verl's v1 trainer keeps batches in TransferQueue; without it, the v0 trainer (same metrics)
        f"trainer.use_v1={importlib.util.find_spec('transfer_queue') is not None}",
    ]
    if importlib.util.find_spec("flash_attn") is None:
        # verl loads its actor with flash_attention_2 unless told otherwise; the canonical forward uses none of
        # transformers' attention, and without flash-attn verl's own (the verl arm) runs on SDPA
        overrides.append("+actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    if arm == "zerokl":
        overrides += [f"actor_rollout_ref.model.external_lib={LIB}",
                      "algorithm.rollout_correction.bypass_mode=True"]
    elif arm not in STOCK_ARMS:
        raise ValueError(f"arm {arm!r}: one of {ARMS}")
    return overrides


def step_metrics(log: Path) -> dict[int, dict]:
    """verl's file logger (VERL_FILE_LOGGER_PATH: one JSON line a step) as {step: its metrics}."""
    return {entry["step"]: entry["data"] for entry in map(json.loads, log.read_text().splitlines())}


def run_verl(overrides: list[str], log: Path, output: Path, timeout_s: float = 3600) -> dict[int, dict]:
    """One verl.trainer.main_ppo process, its output written to `output`; its metrics by step from `log`.
    Raises RuntimeError with the output's tail if it fails."""
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log)}
    with open(output, "w") as out:
        run = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], env=env,
                             timeout=timeout_s, stdout=out, stderr=subprocess.STDOUT)
    if run.returncode != 0:
        raise RuntimeError(f"verl.trainer.main_ppo exited {run.returncode}; the end of {output}:\n"
                           + output.read_text()[-6000:])
    return step_metrics(log)


def summarize(by_step: dict[int, dict]) -> dict:
    """One arm's run: every step's timing_s/* and the log-prob difference, and the median step after the first."""
    steps = sorted(by_step)
    timing = {key.removeprefix("timing_s/"): [by_step[s].get(key) for s in steps]
              for key in sorted({k for s in steps for k in by_step[s] if k.startswith("timing_s/")})}
    steady = timing.get("step", [])[1:] or timing.get("step", [])
    return {"steps": steps, "timing_s": timing, "step_s": statistics.median(steady) if steady else None,
            "rollout_probs_diff_max": [by_step[s].get(DIFF_KEY) for s in steps],
            "response_length_mean": [by_step[s].get("response_length/mean") for s in steps]}


def paired(rounds: list[dict]) -> dict:
    """Each stock arm's step over zerokl's, per round, and their median (keys verl_over_zerokl_step,
    verl_padded_over_zerokl_step: the arms that ran)."""
    doc = {}
    for arm in STOCK_ARMS:
        ratios = [r[arm]["step_s"] / r["zerokl"]["step_s"] for r in rounds
                  if r.get(arm, {}).get("step_s") and r.get("zerokl", {}).get("step_s")]
        if ratios or arm == "verl":
            key = f"{arm.replace('-', '_')}_over_zerokl_step"
            doc[key], doc[f"{key}_median"] = ratios, statistics.median(ratios) if ratios else None
    return doc


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="quickstart")
    p.add_argument("--steps", type=int, default=4, help="verl steps per arm and round (the first is not timed)")
    p.add_argument("--rounds", type=int, default=2, help="both arms per round; odd rounds reverse the order")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--prompts", type=int, help="prompts a step instead of the shape's (mini-batches no larger)")
    p.add_argument("--gsm8k", default=os.environ.get("ZEROKL_GSM8K"),
                   help="folder with GSM8K's train.jsonl and test.jsonl (default: $ZEROKL_GSM8K)")
    p.add_argument("--workdir", help="where the model, data and logs go (default: a temp dir)")
    p.add_argument("--out", help="the JSON document; an unfinished one of the same settings is continued")
    p.add_argument("--runs", type=int, help="stop after this many arm runs (the rest: a later call, same --out)")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if not arms or set(arms) - set(ARMS) or len(set(arms)) != len(arms):
        p.error(f"--arms: each of {', '.join(ARMS)} at most once, got {args.arms}")
    if args.steps < 1 or args.rounds < 1 or (args.runs is not None and args.runs < 1):
        p.error("--steps, --rounds and --runs must be at least 1")
    if not args.gsm8k or not (Path(args.gsm8k) / "train.jsonl").exists():
        p.error(f"--gsm8k: a folder holding GSM8K's train.jsonl and test.jsonl, got {args.gsm8k!r}")
    shape = SHAPES[args.shape]
    if args.prompts is not None:
        if args.prompts < 1:
            p.error("--prompts must be at least 1")
        shape = dataclasses.replace(shape, train_batch_size=args.prompts,
                                    ppo_mini_batch_size=min(shape.ppo_mini_batch_size, args.prompts))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="verl-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    # seeded, so a workdir's saved model of this shape is the one this call would build: later calls reuse it
    model_dir = work / f"model-{args.shape}"
    model = str(model_dir) if (model_dir / "config.json").exists() else byte_level_checkpoint(model_dir, shape.model)
    data = gsm8k_parquet(Path(args.gsm8k), work, {"train": shape.train_batch_size * args.steps, "test": 8})
    import verl
    settings = {"bench": "verl_grpo", "verl": verl.__version__, "shape": args.shape, "settings": shape.__dict__,
                "steps": args.steps, "arms": arms}
    rounds = earlier_rounds(args.out, settings, args.rounds)
    pending = [(r, arm) for r in range(args.rounds) for arm in turn_order(arms, r)
               if not (r < len(rounds) and arm in rounds[r])]
    for r, arm in pending[:args.runs]:
        if r == len(rounds):
            rounds.append({"order": turn_order(arms, r)})
        name = f"{arm}-{r}"
        print(f"[bench] round {r} {arm}: running, output in {work / f'{name}.log'}", file=sys.stderr, flush=True)
        rounds[r][arm] = summarize(run_verl(verl_overrides(shape, model, data, args.steps, arm, name),
                                            work / f"{name}.jsonl", work / f"{name}.log"))
        print(f"[bench] round {r} {arm}: median step {rounds[r][arm]['step_s']} s, "
              f"diff max {rounds[r][arm]['rollout_probs_diff_max']}", file=sys.stderr, flush=True)
        if args.out:  # what has run survives a call that ends before the rest
            write_doc(document(settings, rounds, args.rounds), args.out)
    emit(document(settings, rounds, args.rounds), args.out)


def turn_order(arms: list[str], round_index: int) -> list[str]:
    """Round r runs the arms in order, reversed on odd rounds, so the machine's drift falls on all alike."""
    return arms if round_index % 2 == 0 else arms[::-1]


def document(settings: dict, rounds: list[dict], n_rounds: int) -> dict:
    complete = len(rounds) == n_rounds and all(arm in row for row in rounds for arm in settings["arms"])
    return {**settings, "rounds_planned": n_rounds, "complete": complete, "rounds": rounds, **paired(rounds)}


def earlier_rounds(out: str | None, settings: dict, n_rounds: int) -> list[dict]:
    """The rounds an unfinished document at `out` holds, when it was made with these settings; else none."""
    if not out or not Path(out).exists():
        return []
    doc = json.loads(Path(out).read_text())
    same = all(doc.get(k) == v for k, v in settings.items()) and doc.get("rounds_planned") == n_rounds
    if not same:
        raise SystemExit(f"{out} holds a run with other settings; give another --out to start a new one")
    return doc["rounds"]


if __name__ == "__main__":
    main()
