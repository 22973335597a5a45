"""The tiny LoRA recipe end to end (tiny_lora.yaml: 2 FSDP2 ranks train a PEFT adapter on the frozen base,
2 rollout workers serve it): KL and max |Δ log-prob| exactly 0.0 every step, each push carrying the
adapter alone (the same bits by the object store and by broadcast), and checkpoints holding the adapter
as a PEFT checkpoint that the pool loads."""
from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("peft")

from recipes.config import load_config  # noqa: E402
from recipes.grpo import run  # noqa: E402
from recipes.metrics import read_metrics  # noqa: E402
from rollout_service.lora import load_adapter  # noqa: E402

pytestmark = pytest.mark.slow  # every test runs the recipe, on a local Ray cluster

TINY_LORA = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "tiny_lora.yaml"
SHORT = ["train.steps=3", "train.prompts_per_step=8", "train.save_every=3", "warmup.steps=30",
         "metrics.wandb=false"]


@pytest.fixture(scope="module")
def lora_run(local_ray, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora")
    run(load_config(TINY_LORA, SHORT + [f"run_dir={run_dir}"]), progress=False)
    return run_dir


def test_lora_run_has_exactly_zero_kl_and_trains_the_adapter(lora_run):
    logged = read_metrics(lora_run)
    assert [r["step"] for r in logged] == [1, 2, 3]
    for rec in logged:
        assert rec["rollout_train/kl"] == 0.0 and rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        assert rec["rollout_train/mismatched_tokens"] == 0 and rec["rollout_train/tokens"] > 0
    digests = [r["weights/digest"] for r in logged]
    assert len(set(digests)) == 3  # every step's push carried a changed adapter
    saved = load_adapter(lora_run / "checkpoints" / "step_000003" / "trainer" / "adapter")
    assert saved.r == 8 and len(saved.target_modules) == 7
    assert saved.digest() == digests[-1]  # the checkpoint's adapter is the one the last push carried
    assert all(".lora_" in name for name in saved.tensors)


def test_broadcast_pushes_carry_the_object_stores_adapters(lora_run, tmp_path):
    cfg = load_config(TINY_LORA, SHORT + [f"run_dir={tmp_path}", "trainer.weight_push.transport=broadcast",
                                          "train.save_every=0"])
    run(cfg, progress=False)
    by_store, by_broadcast = read_metrics(lora_run), read_metrics(tmp_path)
    assert [r["weights/digest"] for r in by_broadcast] == [r["weights/digest"] for r in by_store]
    assert [r["rollout/digest"] for r in by_broadcast] == [r["rollout/digest"] for r in by_store]
    assert all(r["rollout_train/kl"] == 0.0 and r["weights/transport"] == "broadcast" for r in by_broadcast)


def test_vllm_workers_serve_the_runs_adapter_with_zero_kl(lora_run, tmp_path):
    """The same run with vLLM rollout workers (rollout.engine.backend=vllm, CPU build): each push becomes a
    LoRARequest in the workers' canonical vLLM model; KL and max |Δ| stay 0.0, and the rollouts and the adapters
    pushed are the native workers' run's bit for bit."""
    pytest.importorskip("vllm")
    cfg = load_config(TINY_LORA, SHORT + [f"run_dir={tmp_path}", "train.save_every=0",
                                          "rollout.engine={backend: vllm, device: cpu}"])
    run(cfg, progress=False)
    on_vllm, native = read_metrics(tmp_path), read_metrics(lora_run)
    assert all(r["rollout_train/kl"] == 0.0 and r["rollout_train/max_abs_logprob_diff"] == 0.0
               and r["rollout_train/tokens"] > 0 for r in on_vllm)
    assert [r["rollout/digest"] for r in on_vllm] == [r["rollout/digest"] for r in native]
    assert [r["weights/digest"] for r in on_vllm] == [r["weights/digest"] for r in native]
    # the prefix caches' share of each step's prefill: vLLM workers have one, native workers none
    assert all(0.0 <= r["rollout/prefix_cache_hit_rate"] <= 1.0 and r["rollout/prefix_cache_prompt_tokens"] > 0
               for r in on_vllm)
    assert not any("rollout/prefix_cache_hit_rate" in r for r in native)


def test_the_stock_lora_pipeline_has_a_nonzero_mismatch(local_ray, tmp_path):
    """The control, bench.grpo_step's stock arm with LoRA: stock vLLM's LoRA serves the pushed adapter and PEFT
    trains it on the unpatched model under FSDP2; rollout and trainer log-probs then differ. (head_dim 32: vLLM's
    stock CPU attention takes no head_dim 16.)"""
    pytest.importorskip("vllm")
    from bench.grpo_arms.run import ARMS
    cfg = load_config(TINY_LORA, SHORT + [f"run_dir={tmp_path}", "train.save_every=0", "model.hidden_size=128",
                                          "rollout.engine={backend: vllm, device: cpu}", *ARMS["stock"]])
    run(cfg, progress=False)
    logged = read_metrics(tmp_path)
    assert all(r["rollout_train/max_abs_logprob_diff"] > 0 and r["rollout_train/mismatched_tokens"] > 0
               for r in logged), logged
    assert len({r["weights/digest"] for r in logged}) == 3  # the adapter still trained and travelled
