"""What the verl integration's tests share: verl's PPO config as its hydra main builds it."""
from __future__ import annotations

import os

from rollout_service.integrations.verl import LIB

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
