"""verl's GSM8K GRPO quick start (FSDP2 actor, vLLM rollout, one GPU) with the zero-KL integration on and off:
on, verl logs training/rollout_probs_diff_max == 0.0 at every step; off, it is > 0 at every step.

The machine has no network: the model is a tiny random Qwen2 with a byte-level tokenizer (its embedding padded
past the tokenizer, as Qwen2.5's is, so verl's vLLM-only vocabulary mask is exercised), and GSM8K comes from
the shared data folder, converted to parquet the way verl's examples/data_preprocess/gsm8k.py converts it.
Run with `pytest -m gpu tests/gpu/test_verl_quickstart_gpu.py` (verl and its dependencies offline:
scripts/verl_gpu_wheels.sh); ZEROKL_GSM8K names the folder holding
train.jsonl / test.jsonl (default: ../shared/data/gsm8k next to the checkout)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

verl = pytest.importorskip("verl", reason="the verl extra")

from rollout_service.integrations.verl import LIB  # noqa: E402

STEPS = 3
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 320  # > 256 bytes + 3 specials: ids 259.. exist in the embedding but not in the tokenizer


def gsm8k_folder() -> Path:
    root = Path(__file__).resolve().parents[3]
    folder = Path(os.environ.get("ZEROKL_GSM8K", root / "shared" / "data" / "gsm8k"))
    if not (folder / "train.jsonl").exists():
        pytest.fail(f"GSM8K jsonl not found in {folder}: set ZEROKL_GSM8K")
    return folder


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
        paths[split] = str(out / f"{split}.parquet")
        datasets.Dataset.from_list(records).to_parquet(paths[split])
    return paths


def byte_level_checkpoint(path: Path) -> str:
    """A tiny random Qwen2 (vocab VOCAB) with a byte-level tokenizer of 259 ids and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rollout_service.tiny_models import tiny_model
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)} | {s: len(alphabet) + i for i, s in enumerate(SPECIALS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=list(SPECIALS))
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) < VOCAB
    model = tiny_model("qwen2", seed=7, vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_heads=8,
                       num_kv_heads=2, num_layers=2, max_positions=2048)
    model.config.eos_token_id = model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.config.pad_token_id = model.generation_config.pad_token_id = vocab["<|endoftext|>"]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def quickstart(model: str, data: dict[str, str], log: Path, zerokl: bool) -> list[float]:
    """verl's PPO main with the quick start's GRPO settings for STEPS steps; each step's
    training/rollout_probs_diff_max from verl's file logger."""
    import importlib.util
    overrides = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data['train']}", f"data.val_files={data['test']}",
        "data.train_batch_size=8", "data.max_prompt_length=512", "data.max_response_length=64",
        "data.filter_overlong_prompts=True", "data.truncation=error",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "trainer.logger=[console,file]", "trainer.project_name=zerokl",
        f"trainer.experiment_name={'on' if zerokl else 'off'}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False",
        # verl's v1 trainer keeps batches in TransferQueue; without it, the v0 trainer (same metrics)
        f"trainer.use_v1={importlib.util.find_spec('transfer_queue') is not None}",
    ]
    if importlib.util.find_spec("flash_attn") is None:
        # verl loads its actor with flash_attention_2 unless told otherwise; the canonical forward uses none of
        # transformers' attention, and without flash-attn verl's own (the off arm) runs on SDPA
        overrides.append("+actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    if zerokl:
        overrides.append(f"actor_rollout_ref.model.external_lib={LIB}")
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log)}
    run = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], env=env, timeout=1800,
                         capture_output=True, text=True)
    assert run.returncode == 0, (run.stdout[-4000:], run.stderr[-8000:])
    diffs = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if "training/rollout_probs_diff_max" in entry["data"]:
            diffs[entry["step"]] = entry["data"]["training/rollout_probs_diff_max"]
    assert sorted(diffs) == list(range(1, STEPS + 1)), f"each step logs the difference: {diffs}"
    return [diffs[s] for s in sorted(diffs)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("the verl quick start needs a CUDA GPU")
    root = tmp_path_factory.mktemp("verl_quickstart")
    model = byte_level_checkpoint(root / "model")
    data = gsm8k_parquet(gsm8k_folder(), root, {"train": 64, "test": 8})
    return root, model, data


def test_quickstart_logs_zero_difference_at_every_step(setup):
    root, model, data = setup
    diffs = quickstart(model, data, root / "on.jsonl", zerokl=True)
    assert diffs == [0.0] * STEPS, diffs


def test_quickstart_without_the_integration_differs_at_every_step(setup):
    root, model, data = setup
    diffs = quickstart(model, data, root / "off.jsonl", zerokl=False)
    assert all(d > 0.0 for d in diffs), diffs
