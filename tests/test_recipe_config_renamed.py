"""Trainer keys from before the sections (trainer.lr, trainer.micro_batch_size, trainer.weight_sync, ...) still
load, in a file and as overrides, to the same config as their new keys, each with one deprecation message
that names the new key; new keys load without one; unknown keys are refused as before."""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from recipes.config import (
    NUMERIC_RANGES,
    RENAMED_KEYS,
    ConfigError,
    ConfigKeyDeprecated,
    RecipeConfig,
    load_config,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "configs" / "tiny.yaml"
# a value of each old key's field other than its default, in override form
VALUES = {
    "resources_per_rank": "{num_cpus: 2}", "placement_strategy": "SPREAD", "torch_threads": "3", "lr": "0.002",
    "betas": "[0.8, 0.9]", "weight_decay": "0.1", "max_grad_norm": "2.0", "clip_low": "0.1", "clip_high": "0.3",
    "old_logprobs": "recompute", "scale_advantages": "false", "mini_batches": "2", "micro_batch_size": "4",
    "max_tokens_per_micro_batch": "512", "packing": "false", "activation_checkpointing": "true",
    "weight_sync": "object_store", "weight_bucket_mb": "64", "weight_stage_mb": "0", "weight_switch": "finish-then-switch",
    "weight_push_timeout_s": "60.0", "arm_weight_push": "false",
}


def _load(overrides: list[str], path=None) -> tuple[RecipeConfig, list[str]]:
    """The config and the deprecation messages its loading gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(path, overrides)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigKeyDeprecated)]


def test_every_old_key_has_a_value_here():
    assert sorted(VALUES) == sorted(old.split(".", 1)[1] for old in RENAMED_KEYS)


@pytest.mark.parametrize("old", sorted(RENAMED_KEYS))
def test_an_old_override_is_its_new_key_with_one_message(old):
    new, value = RENAMED_KEYS[old], VALUES[old.split(".", 1)[1]]
    extra = ["trainer.weight_push.transport=object_store"] if old == "trainer.weight_switch" else []
    cfg_new, said_new = _load([f"{new}={value}", *extra])
    cfg_old, said_old = _load([f"{old}={value}", *extra])
    assert cfg_old == cfg_new and cfg_new != load_config(None, extra)
    assert said_new == []
    assert len(said_old) == 1 and old in said_old[0] and f"use {new}" in said_old[0]


@pytest.mark.parametrize("old", sorted(RENAMED_KEYS))
def test_an_old_key_in_a_file_is_its_new_key_with_one_message(old, tmp_path):
    section, key = RENAMED_KEYS[old].split(".")[1:]
    value = VALUES[old.split(".", 1)[1]]
    old_file, new_file = tmp_path / "old.yaml", tmp_path / "new.yaml"
    push = "  weight_push: {transport: object_store}\n" if old == "trainer.weight_switch" else ""
    old_file.write_text(f"trainer:\n{push}  {old.split('.', 1)[1]}: {value}\n")
    other = "    transport: object_store\n" if push else ""
    new_file.write_text(f"trainer:\n  {section}:\n{other}    {key}: {value}\n")
    cfg_old, said_old = _load([], old_file)
    cfg_new, said_new = _load([], new_file)
    assert cfg_old == cfg_new and said_new == []
    assert len(said_old) == 1 and str(old_file) in said_old[0] and f"use trainer.{section}.{key}" in said_old[0]


def test_an_old_key_under_a_mapping_and_the_file_it_overrides():
    cfg, said = _load(["trainer.resources_per_rank.num_gpus=1", "trainer.lr=0.005"], TINY)
    assert cfg.trainer.placement.resources_per_rank == {"num_cpus": 0.5, "num_gpus": 1}
    assert cfg.trainer.optimizer.lr == 0.005
    assert len(said) == 2 and "use trainer.placement.resources_per_rank" in said[0]


def test_an_old_override_wins_over_the_new_key_in_the_file():
    cfg, _ = _load(["trainer.lr=0.007"], TINY)  # tiny.yaml sets trainer.optimizer.lr
    assert cfg.trainer.optimizer.lr == 0.007


def test_a_key_set_both_ways_in_one_file_is_refused(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("trainer:\n  lr: 0.1\n  optimizer: {lr: 0.2}\n")
    with pytest.raises(ConfigError, match=r"trainer\.lr and trainer\.optimizer\.lr are both set"):
        _load([], path)


def test_old_keys_in_plain_data_load_too():
    """A run's config.yaml written before the sections (resumed runs) reads the same."""
    cfg = load_config(None, ["trainer.optimizer.lr=0.003", "trainer.weight_push.transport=broadcast"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigKeyDeprecated)
        assert RecipeConfig.from_dict({"trainer": {"lr": 0.003, "weight_sync": "broadcast"}}) == cfg


def test_unknown_keys_are_still_refused_by_name():
    with pytest.raises(ConfigError, match=r"^trainer\.lrr: unknown key"):
        load_config(TINY, ["trainer.lrr=1"])
    with pytest.raises(ConfigError, match=r"^trainer\.optimizer\.learning_rate: unknown key"):
        load_config(TINY, ["trainer.optimizer.learning_rate=1"])


def test_numeric_ranges_name_the_new_key_whichever_key_set_it():
    defaults = RecipeConfig.from_dict({"model": {"lora": {}}})  # optional sections on, with their defaults
    for key in NUMERIC_RANGES:  # every range is of a field that exists
        value = defaults
        for part in key.removesuffix("[]").split("."):
            value = getattr(value, part)
    for override in ("trainer.lr=-1", "trainer.optimizer.lr=-1"):
        with pytest.raises(ConfigError, match=r"^trainer\.optimizer\.lr must be > 0, got -1"):
            _load([override])
    with pytest.raises(ConfigError, match=r"^trainer\.weight_push\.bucket_mb must be >= 1"):
        _load(["trainer.weight_bucket_mb=0"])


def test_a_user_sees_the_message_on_stderr_and_an_unknown_key_still_exits_2():
    """As a user runs the recipe: the old key's message once on stderr, then the refusal, status 2."""
    proc = subprocess.run([sys.executable, "-m", "recipes.grpo", "--config", str(TINY), "trainer.lr=0.001",
                           "trainer.lrr=1"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("trainer.lr is deprecated") == 1 and "use trainer.optimizer.lr" in proc.stderr
    assert "python -m recipes.grpo: trainer.lrr: unknown key" in proc.stderr and "Traceback" not in proc.stderr


def test_an_old_attribute_of_the_trainer_section_reads_its_new_place():
    from recipes.config import TrainerConfig
    trainer = load_config(None, ["trainer.weight_push.transport=broadcast", "trainer.optimizer.lr=0.004"]).trainer
    with pytest.warns(DeprecationWarning, match="weight_push.transport"):
        assert trainer.weight_sync == "broadcast"
    with pytest.warns(DeprecationWarning, match="optimizer.lr"):
        assert trainer.lr == 0.004
    with pytest.raises(AttributeError):
        TrainerConfig().learning_rate  # noqa: B018
