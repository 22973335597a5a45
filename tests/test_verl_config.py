"""The verl integration's config surface: which verl keys turn it on, and the errors for the settings it does not
run, on verl's own config (composed by hydra as verl's main composes it)."""
from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="the verl extra (CI installs it)")

from rollout_service.integrations.verl import LIB, check_config, enabled  # noqa: E402
from rollout_service.integrations.verl.config import VerlConfigError, select  # noqa: E402
from verl_shared import QUICKSTART, ZEROKL, verl_config  # noqa: E402


def test_quickstart_with_zero_kl_passes():
    from verl_shared import LIB as documented
    assert LIB == documented
    config = verl_config(*QUICKSTART, *ZEROKL)
    assert enabled(config.actor_rollout_ref.model)
    check_config(config)


def test_bypass_mode_is_accepted():
    check_config(verl_config(*QUICKSTART, *ZEROKL, "algorithm.rollout_correction.bypass_mode=True"))


def test_off_by_default_and_then_nothing_is_checked():
    config = verl_config(*QUICKSTART, "actor_rollout_ref.rollout.name=sglang")
    assert not enabled(config.actor_rollout_ref.model)
    check_config(config)  # sglang, FSDP1: verl's business, not ours


def test_external_lib_as_a_list_turns_it_on():
    assert enabled({"external_lib": ["some.other_lib", LIB]})
    assert not enabled({"external_lib": "some.other_lib"})
    assert not enabled({})


@pytest.mark.parametrize("override, words", [
    ("actor_rollout_ref.rollout.name=sglang", "rollout.name='sglang'"),
    ("actor_rollout_ref.actor.strategy=fsdp", "actor.strategy='fsdp'"),
    ("actor_rollout_ref.rollout.calculate_log_probs=False", "calculate_log_probs=False"),
    ("actor_rollout_ref.rollout.top_p=0.9", "top_p=0.9"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size=2"),
    ("actor_rollout_ref.model.lora_rank=8", "lora_rank=8"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides={architectures:[Qwen2ForCausalLM]}",
     "['hf_overrides']"),
])
def test_unsupported_setting_raises_and_names_it(override, words):
    config = verl_config(*QUICKSTART, *ZEROKL, override)
    with pytest.raises(VerlConfigError) as info:
        check_config(config)
    assert words in str(info.value)


def test_every_problem_is_listed_at_once():
    config = verl_config(*QUICKSTART, *ZEROKL, "actor_rollout_ref.rollout.name=sglang",
                         "actor_rollout_ref.rollout.top_k=20")
    with pytest.raises(VerlConfigError) as info:
        check_config(config)
    assert "rollout.name='sglang'" in str(info.value) and "top_k=20" in str(info.value)


def test_verl_validate_config_runs_the_check():
    """The driver's hook: verl's own validate_config (what its PPO main calls first) raises our error."""
    import verl.utils.config as verl_config_module
    config = verl_config(*QUICKSTART, *ZEROKL, "actor_rollout_ref.rollout.name=sglang")
    with pytest.raises(VerlConfigError, match="only vllm runs the canonical model"):
        verl_config_module.validate_config(config, use_reference_policy=True, use_critic=False)


def test_select_reads_missing_mandatory_values_as_default():
    from omegaconf import OmegaConf
    cfg = OmegaConf.create({"a": {"b": "???", "c": 3}})
    assert select(cfg, "a.b", "d") == "d" and select(cfg, "a.c") == 3 and select(cfg, "a.x.y", 7) == 7
