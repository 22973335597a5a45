"""The GRPO recipe on GPUs with the vLLM plugin engine, as users run it: colocated on one GPU (the
engine sleeping while the rank trains, weights by CUDA IPC) and split over two (NCCL), KL exactly 0
at every step; the stock arm on the same GPU logs a non-zero KL."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from recipes.config import load_config  # noqa: E402
from recipes.grpo import run  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "tiny.yaml"
ONE_EACH = ["train.steps=3", "train.prompts_per_step=8", "warmup.steps=20", "rollout.num_workers=1",
            "trainer.num_ranks=1", "trainer.device=cuda", "metrics.wandb=false",
            "rollout.engine={device: cuda, backend: vllm, gpu_memory_utilization: 0.25}"]
COLOCATED = ["placement=colocated", "rollout.resources_per_worker.num_gpus=0.5",
             "trainer.placement.resources_per_rank.num_gpus=0.5"]
STOCK = ["numerics=stock", "rollout.determinism=off", "trainer.loss.old_logprobs=recompute"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(tmp_path, overrides):
    return run(load_config(TINY, ONE_EACH + overrides + [f"run_dir={tmp_path}"]), progress=False)["records"]


@pytest.mark.parametrize("sleep,extra", [(True, []), (True, ["rollout.engine.early_weights_wake=true"]),
                                         (False, ["rollout.sleep_while_training=false"])],
                         ids=["engine-sleeps", "weights-wake-behind-sleep", "engine-awake"])
def test_colocated_vllm_run_has_zero_kl(cluster, tmp_path, sleep, extra):
    """Also with the weights' memory mapped again behind each sleep (early_weights_wake), and with the
    engine kept awake while the rank trains (built without vLLM's sleep mode, never asked to sleep)."""
    records = _run(tmp_path, COLOCATED + extra)
    assert [r["step"] for r in records] == [1, 2, 3]
    for rec in records:
        assert rec["rollout_train/kl"] == 0.0 and rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        assert rec["rollout_train/tokens"] > 0
        assert rec["weights/transport"] == "ipc"
        assert (rec["perf/sleep_s"] > 0.0) == sleep
        assert rec["perf/sync_armed_ahead_s"] > 0.0  # the pool's begin asked as the train step started
        # after the first step (its begin may still be under way when its backward ends), the engines are
        # asked to wake after the step's last backward: before the stage (the check), not as it starts
        # (the same call on an engine kept awake does nothing)
        assert rec["step"] == 1 or rec["perf/sync_woken_ahead_s"] > rec["perf/sync_check_s"], rec
        # the worker's bucket call (wake, check, load, settle) runs inside the sender's send
        assert 0.0 < rec["perf/sync_worker_call_s"] <= rec["perf/sync_send_s"]
        assert rec["perf/sync_worker_wake_s"] + rec["perf/sync_worker_load_s"] <= rec["perf/sync_worker_call_s"]


def test_colocated_stock_arm_has_nonzero_kl(cluster, tmp_path):
    records = _run(tmp_path, COLOCATED + STOCK)
    assert all(r["rollout_train/kl"] != 0.0 and r["rollout_train/max_abs_logprob_diff"] > 0.0 for r in records)


def test_split_vllm_run_has_zero_kl(cluster, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    records = _run(tmp_path, ["rollout.resources_per_worker.num_gpus=1",
                              "trainer.placement.resources_per_rank.num_gpus=1"])
    for rec in records:
        assert rec["rollout_train/kl"] == 0.0 and rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        assert rec["weights/transport"] == "broadcast" and rec["perf/sync_armed_ahead_s"] > 0.0


TINY_LORA = TINY.with_name("tiny_lora.yaml")
LORA_ONE_EACH = ONE_EACH + ["model.hidden_size=128", "rollout.engine.early_weights_wake=true"]  # head_dim 32


@pytest.mark.parametrize("level", [None, 2], ids=["lora-engine-default-level", "level-2"])
@pytest.mark.parametrize("arm", ["canonical", "stock"])
def test_colocated_lora_runs(cluster, tmp_path, arm, level):
    """LoRA colocated on one GPU, the engine sleeping while the rank trains and each push the adapter alone.
    The engine built for adapters sleeps at level 1 by default; at level 2 its base is reloaded from the host
    copy after each sleep, which a stock model wrapped by vLLM's LoRA takes only through
    compat.lora_wrappers_lifted. Zero KL: exactly 0 at every step; the stock LoRA pipeline: non-zero."""
    extra = [] if level is None else [f"rollout.engine.sleep_level={level}"]
    records = run(load_config(TINY_LORA, LORA_ONE_EACH + COLOCATED + (STOCK if arm == "stock" else []) + extra
                              + [f"run_dir={tmp_path}"]), progress=False)["records"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert len({r["weights/digest"] for r in records}) == 3  # the adapter trained and travelled
    for rec in records:
        assert rec["weights/transport"] == "ipc" and rec["perf/sleep_s"] > 0.0
        if arm == "canonical":
            assert rec["rollout_train/kl"] == 0.0 and rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        else:
            assert rec["rollout_train/max_abs_logprob_diff"] > 0.0, rec
