"""The typed recipe config: the shipped files load, bad keys and values are named by their dotted path,
and a config round-trips through plain data and YAML (the run's config.yaml, a checkpoint's)."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

from recipes.checkpoint import CONFIG_FILE, write_state
from recipes.config import ConfigError, RecipeConfig, RolloutConfig, coerce_numbers, load_config
from recipes.grpo import build_config
from recipes.placement import placement_bundles

CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
TINY = CONFIGS / "tiny.yaml"


def _leaves(node: dict, prefix: str = ""):
    """(dotted key, value) for every value in a YAML mapping; engine options and Ray resources are
    forwarded as mappings, so they count as one value."""
    for key, value in node.items():
        if isinstance(value, dict) and key not in ("engine", "resources_per_worker", "resources_per_rank"):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("name", ["tiny.yaml", "tiny_moe.yaml", "gsm8k_qwen.yaml", "gpu_colocated.yaml", "gpu_split.yaml",
                                  "gpu_quality.yaml"])
def test_shipped_configs_load_with_every_value(name):
    raw = coerce_numbers(yaml.safe_load((CONFIGS / name).read_text()))
    cfg = load_config(CONFIGS / name)
    leaves = dict(_leaves(raw))
    assert len(leaves) > 20
    for key, value in leaves.items():
        assert _get(cfg, key) == value, key
    assert isinstance(cfg.trainer.optimizer.lr, float)  # "1.0e-6" is a string to YAML 1.1


def test_unknown_key_in_a_file_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout: {n: 4, temprature: 0.7}\n")
    hint = r"rollout\.temprature: unknown key \(did you mean rollout\.temperature\?\)"
    with pytest.raises(ConfigError, match=hint):
        load_config(path)
    path.write_text("trainr: {lr: 0.1}\n")
    with pytest.raises(ConfigError, match=r"^trainr: unknown key \(did you mean trainer\?\); known: name, seed"):
        load_config(path)


def test_unknown_key_in_an_override_is_named():
    hint = r"^rollout\.nn: unknown key \(did you mean rollout\.n\?\); known: .*\bn\b"
    with pytest.raises(ConfigError, match=hint):
        load_config(TINY, ["rollout.nn=3"])
    with pytest.raises(ValueError, match=r"^model\.qqq: unknown key; known:"):  # ConfigError is a ValueError
        load_config(TINY, ["model.qqq=1"])


@pytest.mark.parametrize("override, message", [
    ("trainer.optimizer.lr=abc", "trainer.optimizer.lr must be a float, got 'abc'"),
    ("train.steps=2.5", "train.steps must be an int, got 2.5"),
    ("rollout.n=true", "rollout.n must be an int, got True"),  # a bool is not an int
    ("metrics.wandb=1", "metrics.wandb must be true or false, got 1"),
    ("trainer.optimizer.betas=[0.9, x]", "trainer.optimizer.betas[1] must be a float, got 'x'"),
    ("rollout.engine=4", "rollout.engine must be a mapping, got 4"),
    ("task.path=[a]", "task.path must be a string or null, got ['a']"),
    ("warmup=3", "warmup must be a mapping, got 3"),
])
def test_wrong_type_is_named(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert str(err.value) == message


def test_ints_are_floats_where_floats_are_meant_and_bare_off_is_off(tmp_path):
    cfg = load_config(TINY, ["trainer.optimizer.lr=1", "trainer.optimizer.betas=[0, 0]"])  # AdamW: betas in [0, 1)
    assert cfg.trainer.optimizer.lr == 1.0 and type(cfg.trainer.optimizer.lr) is float
    assert [type(b) for b in cfg.trainer.optimizer.betas] == [float, float]
    path = tmp_path / "off.yaml"
    path.write_text("rollout:\n  determinism: off\n")  # YAML 1.1: false
    assert load_config(path).rollout.determinism == "off"


def test_defaults_and_override_round_trip(tmp_path):
    cfg = load_config(None, ["trainer.optimizer.lr=3e-5", "rollout.engine.window=4", "model.hidden_size=32"])
    assert cfg.trainer.optimizer.lr == 3e-5 and cfg.rollout.engine == {"window": 4}
    assert cfg.model.hidden_size == 32
    assert cfg.rollout == RolloutConfig(engine={"window": 4})  # the rest: defaults
    data = cfg.to_dict()
    assert data["trainer"]["optimizer"]["lr"] == 3e-5 and data["rollout"]["engine"] == {"window": 4}
    assert RecipeConfig.from_dict(data) == cfg
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg
    assert load_config(path, ["train.steps=7"]) == dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, steps=7))


def test_config_is_checked_on_every_change():
    cfg = load_config(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.n = 1
    with pytest.raises(ConfigError, match="rollout.n must be >= 2"):
        dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, n=1))


def _args(**kw):
    base = dict(config=None, resume=None, determinism=None, run_dir=None, overrides=[])
    return argparse.Namespace(**{**base, **kw})


def test_cli_config_flags_and_resume_read_the_checkpoint_config(tmp_path):
    cfg = build_config(_args(config=str(TINY), determinism="off", run_dir=str(tmp_path), overrides=["seed=5"]))
    assert (cfg.rollout.determinism, cfg.run_dir, cfg.seed) == ("off", str(tmp_path), 5)
    ckpt = tmp_path / "checkpoints" / "step_000002"
    write_state(ckpt, {"step": 2, "cursor": 16, "digest": None}, cfg)
    assert (ckpt / CONFIG_FILE).is_file()
    resumed = build_config(_args(resume=str(tmp_path), overrides=["train.steps=9"]))
    assert resumed == dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=9))
    with pytest.raises(ConfigError, match="train.stepz"):
        build_config(_args(resume=str(tmp_path), overrides=["train.stepz=9"]))


def test_malformed_override_is_named():
    with pytest.raises(ConfigError, match=r"^trainer\.optimizer\.betas: the value '\[0\.9' is not YAML"):
        load_config(TINY, ["trainer.optimizer.betas=[0.9"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(TINY, ["trainer.optimizer.lr"])


@pytest.mark.parametrize("overrides, message", [
    (["numerics=stock"], r"numerics: stock needs trainer.loss.old_logprobs=recompute"),
    (["numerics=stock", "trainer.loss.old_logprobs=recompute"], r"numerics: stock runs rollout.determinism=off"),
    (["placement=colocated", "rollout.num_workers=1"], r"rollout.num_workers \(1\) must equal trainer.num_ranks \(2\)"),
    (["placement=together"], r"placement must be one of split, colocated"),
])
def test_numerics_and_placement_settings_that_do_not_fit_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "tiny.yaml", overrides)


@pytest.mark.parametrize("awake", [False, True])
def test_colocated_vllm_engines_are_built_with_sleep_mode_only_when_they_sleep(awake):
    """vLLM's sleep mode (its cumem allocator) is asked for where the engines sleep while the trainer
    steps: colocated, unless rollout.sleep_while_training is false; never for the split placement."""
    from recipes.rollouts import engine_options
    vllm_engine = "rollout.engine={backend: vllm, device: cpu}"
    colocated = load_config(CONFIGS / "gpu_colocated.yaml",
                            [vllm_engine, f"rollout.sleep_while_training={str(not awake).lower()}"])
    split = load_config(CONFIGS / "gpu_split.yaml", [vllm_engine])
    assert engine_options(colocated).get("sleep_mode", False) is (not awake)
    assert "sleep_mode" not in engine_options(split)


def test_placement_bundles_keep_a_split_runs_workers_off_its_ranks_gpus():
    """Split: a bundle per worker, then one per rank, each a whole GPU of its own, so that two jobs
    taking half of each (bench.grpo_step --interleave) stay split. Colocated: a bundle per rank that
    rank i and worker i share."""
    split = load_config(CONFIGS / "gpu_split.yaml", ["rollout.num_workers=2", "trainer.num_ranks=3"])
    assert placement_bundles(split) == [{"CPU": 2, "GPU": 1}] * 2 + [{"CPU": 2, "GPU": 1}] * 3
    cpu_split = load_config(TINY, [])  # CPU ranks ask for no GPU
    assert placement_bundles(cpu_split) == [{"CPU": 0.5}] * 4
    colocated = load_config(CONFIGS / "gpu_colocated.yaml", [])
    assert placement_bundles(colocated) == [{"CPU": 4, "GPU": 1.0}]
    too_much = load_config(CONFIGS / "gpu_colocated.yaml", ["trainer.placement.resources_per_rank.num_gpus=0.9"])
    with pytest.raises(ValueError, match="add up to 1.4 > 1"):
        placement_bundles(too_much)


@pytest.mark.parametrize("override", [
    "trainer.optimizer.lr=0", "trainer.optimizer.lr=-1e-4", "trainer.optimizer.lr=.nan", "trainer.optimizer.lr=.inf",
    "warmup.lr=0", "warmup.lr=-3e-3", "trainer.optimizer.betas=[1.0, 0.999]", "trainer.optimizer.betas=[0.9, -0.1]",
    "trainer.optimizer.betas=[0.9]", "trainer.optimizer.betas=[0.9, 0.99, 0.9]",
    "trainer.optimizer.weight_decay=-0.01", "trainer.optimizer.max_grad_norm=-1", "trainer.optimizer.max_grad_norm=.nan",
    "trainer.loss.clip_low=-0.2", "trainer.loss.clip_high=-0.1",
    "rollout.temperature=-0.7", "rollout.temperature=.nan", "rollout.top_p=0", "rollout.top_p=1.5",
    "rollout.top_k=-2", "rollout.max_tokens=0", "rollout.num_workers=0", "rollout.n=1",
    "rollout.start_timeout_s=0", "rollout.length_sigma=-0.5",
    "train.steps=0", "train.prompts_per_step=0", "train.save_every=-1", "train.async_steps=-1",
    "trainer.num_ranks=0", "trainer.batching.mini_batches=0", "trainer.batching.micro_batch_size=-1",
    "trainer.batching.max_tokens_per_micro_batch=-1", "trainer.placement.torch_threads=-1",
    "trainer.weight_push.bucket_mb=0",
    "trainer.weight_push.stage_mb=-1", "trainer.weight_push.timeout_s=0", "trainer.weight_push.timeout_s=-5",
    "warmup.steps=-1", "warmup.batch_size=0",
    "task.max_operand=-1", "task.max_prompt_tokens=-1", "task.stop_token_ids=[2, -1]",
    "model.hidden_size=0", "model.num_layers=0", "model.num_heads=-4", "model.num_kv_heads=0",
    "model.intermediate_size=0", "model.max_positions=0", "model.vocab_size=0", "seed=-1",
])
def test_every_numeric_field_out_of_range_is_named(override):
    """A value the run cannot use is refused at load, naming its key, not steps later inside an actor."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert key in str(err.value), str(err.value)


def test_head_dim_out_of_range_is_named():
    with pytest.raises(ConfigError, match=r"model\.head_dim must be >= 1, got 0"):
        load_config(CONFIGS / "tiny_moe.yaml", ["model.arch=qwen3", "model.head_dim=0"])


@pytest.mark.parametrize("override", [
    "trainer.optimizer.max_grad_norm=null", "trainer.optimizer.max_grad_norm=0", "rollout.temperature=0",
    "rollout.top_k=-1", "rollout.top_k=0", "rollout.top_p=1", "trainer.optimizer.betas=[0, 0]",
    "trainer.optimizer.weight_decay=0", "train.save_every=0",
    "trainer.loss.clip_low=0", "warmup.steps=0", "task.max_prompt_tokens=0", "trainer.placement.torch_threads=0", "seed=0",
])
def test_boundary_values_that_mean_off_are_accepted(override):
    load_config(TINY, [override])


def test_missing_config_file_names_the_configs_that_ship(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "nope.yaml")
    message = str(err.value)
    assert str(tmp_path / "nope.yaml") in message and "no such config file" in message
    assert all(f"recipes/configs/{p.name}" in message for p in CONFIGS.glob("*.yaml"))


def test_config_file_that_is_not_yaml_is_named(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("trainer: {lr: 1e-4\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not YAML"):
        load_config(path)


@pytest.mark.parametrize("argv, message", [
    (["--config", str(TINY), "trainer.optimizer.lr=abc"], "trainer.optimizer.lr must be a float, got 'abc'"),
    (["--config", str(TINY), "trainer.optimizer.lr=-1"], "trainer.optimizer.lr must be > 0"),
    (["--config", str(TINY), "trainer.optimizer.lr"], "override 'trainer.optimizer.lr' is not key=value"),
    (["--config", str(TINY), "trainer.optimizer.betas=[0.9"],
     "trainer.optimizer.betas: the value '[0.9' is not YAML"),
    (["--config", "nope.yaml"], "nope.yaml: no such config file"),
    (["--resume", "no-such-run"], "--resume no-such-run: no complete checkpoint"),
])
def test_cli_config_errors_print_the_message_and_exit_2(argv, message, capsys):
    from recipes.grpo import main
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m recipes.grpo: {message}") and "Traceback" not in err, err


def test_cli_config_error_is_one_message_not_a_traceback(tmp_path):
    """As a user runs it: the message on stderr, nothing else, status 2 (no Ray started)."""
    import subprocess
    import sys
    repo = CONFIGS.parents[1]
    proc = subprocess.run([sys.executable, "-m", "recipes.grpo", "--config", "nope.yaml"], cwd=repo,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith("python -m recipes.grpo: nope.yaml: no such config file;")
    assert "recipes/configs/tiny.yaml" in proc.stderr


def test_the_lora_section_is_optional_typed_and_checked():
    from recipes.config import RecipeConfig
    assert RecipeConfig().model.lora is None
    cfg = RecipeConfig.from_dict({"model": {"lora": {"r": 8, "target_modules": ["all-linear"]}}})
    assert cfg.model.lora.r == 8 and cfg.model.lora.alpha == 32.0 and len(cfg.model.lora.targets()) == 7
    assert cfg.model.lora.peft_config().lora_dropout == 0.0
    for bad, words in ((({"r": 0}), r"model\.lora\.r must be >= 1"),
                       ({"target_modules": ["w1"]}, r"model\.lora\.target_modules must name"),
                       ({"rank": 8}, r"model\.lora\.rank: unknown key")):
        with pytest.raises(ConfigError, match=words):
            RecipeConfig.from_dict({"model": {"lora": bad}})
    stock = {"numerics": "stock", "trainer": {"loss": {"old_logprobs": "recompute"}}, "model": {"lora": {}}}
    with pytest.raises(ConfigError, match="rollouts are vLLM's own LoRA"):  # the stock LoRA pipeline is vLLM's
        RecipeConfig.from_dict({**stock, "rollout": {"determinism": "off", "engine": {"backend": "native"}}})
    RecipeConfig.from_dict({**stock, "rollout": {"determinism": "off", "engine": {"backend": "vllm"}}})
