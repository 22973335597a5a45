"""Recipe configuration: typed sections whose field defaults are the recipe's defaults, read from a
YAML file and `key.sub=value` overrides, and checked once, with every error naming its dotted key.

    cfg = load_config("recipes/configs/tiny.yaml", ["trainer.lr=2e-3"])
    cfg.rollout.n, cfg.trainer.lr          # typed attributes
    cfg.to_dict()                          # plain data: wandb, the run's config.yaml (to_yaml)
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kernels import TREE_WIDTHS
from rollout_service.params import DETERMINISM_MODES
from rollout_service.tiny_models import ARCHITECTURES
from rollout_service.service.weight_sync import TRANSPORTS

TASK_KINDS = ("tiny", "gsm8k")
MODEL_SOURCES = ("tiny", "hf")
OLD_LOGPROBS = ("rollout", "recompute")
TRAINER_DEVICES = ("cpu", "cuda")
NUMERICS = ("canonical", "stock")
PLACEMENTS = ("split", "colocated")
WEIGHT_TRANSPORTS = ("auto", *TRANSPORTS)


class ConfigError(ValueError):
    """A bad recipe config; the message names the key by its dotted path."""


@dataclass(frozen=True)
class TaskConfig:
    kind: str = "tiny"  # tiny | gsm8k
    # tiny: "a<op>b=" problems with 0 <= a, b <= max_operand
    max_operand: int = 19
    ops: str = "+"
    # gsm8k: the hub's split, or path = a directory of <split>.jsonl files (or one JSONL file)
    split: str = "train"
    path: str | None = None
    max_prompt_tokens: int | None = None  # longer prompts are dropped; null keeps all
    stop_token_ids: list[int] = field(default_factory=list)  # besides EOS and the chat end-of-turn tokens


@dataclass(frozen=True)
class ModelConfig:
    source: str = "tiny"  # tiny (made by the project) | hf (a hub id or local checkpoint in `name`)
    name: str | None = None
    tokenizer: str | None = None  # hf: when it is not `name`'s
    # tiny: rollout_service.tiny_models options; null keeps that module's default
    arch: str | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    max_positions: int | None = None
    vocab_size: int | None = None  # null: the tokenizer's; more: a real model's logits width (benchmarks)

    def tiny_options(self) -> dict:
        """The tiny model's keyword options that are set."""
        names = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "max_positions")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


@dataclass(frozen=True)
class CanonicalTreeConfig:
    # Row-parallel segment tree width (1, 2, 4 or 8: the largest TP degree that reproduces the trainer);
    # null = ZEROKL_TREE_SEGMENTS or 8. Given to every rollout worker and trainer rank.
    tree_segments: int | None = None


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised steps on the task's answers before GRPO (0 = none); skipped when resuming."""
    steps: int = 0
    lr: float = 3e-3
    batch_size: int = 64
    device: str = "cpu"  # cpu | cuda (the driver's GPU, before the workers and ranks start)


@dataclass(frozen=True)
class RolloutConfig:
    num_workers: int = 2
    pool_name: str | None = None  # default: unique per run
    # Forwarded verbatim: engine options go to RolloutWorker / EngineConfig, which check them;
    # resources are Ray actor options.
    engine: dict = field(default_factory=dict)
    resources_per_worker: dict = field(default_factory=lambda: {"num_cpus": 1})
    # how long a worker may take to build its engine; a stock vLLM engine compiles its graphs
    # (inductor) on first start, which on a fresh GPU machine takes minutes
    start_timeout_s: float = 120.0
    determinism: str = "verified"
    n: int = 8  # samples per prompt (the GRPO group)
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    # record each token's MoE routing and log rollout_train/routing_agreement; null: on for MoE
    # policies on native-engine workers without TP (recipes.rollouts.records_routing)
    return_routed_experts: bool | None = None


@dataclass(frozen=True)
class TrainerConfig:
    num_ranks: int = 2
    device: str = "cpu"  # cpu (gloo) | cuda (NCCL, one GPU per rank)
    resources_per_rank: dict = field(default_factory=lambda: {"num_cpus": 1})  # Ray actor options, forwarded
    placement_strategy: str = "PACK"  # Ray placement-group strategy for GPU ranks (split placement)
    torch_threads: int = 1
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # null or 0: no clipping
    clip_low: float = 0.2
    clip_high: float = 0.2
    mini_batches: int = 1  # optimizer steps per rollout batch
    micro_batch_size: int = 0  # sequences per forward on a rank; 0 = all at once
    old_logprobs: str = "rollout"  # or "recompute" (the trainer's own, before the update)
    scale_advantages: bool = True  # divide by the group's std (GRPO); False = mean-centred only
    # How weights reach the rollout workers (rollout_service.service.weight_sync): auto | object_store |
    # broadcast | ipc. auto: ipc when the workers share rank 0's GPU, broadcast when they have GPUs of
    # their own, else the object store.
    weight_sync: str = "auto"
    weight_bucket_mb: int = 256  # bucket size of broadcast / ipc pushes


@dataclass(frozen=True)
class TrainLoopConfig:
    steps: int = 10
    prompts_per_step: int = 8
    save_every: int = 0  # checkpoint every N steps (0 = only at the end)
    save_final: bool = True  # checkpoint the last step (benchmarks turn it off: it is no step's work)
    save_rollouts: bool = False


@dataclass(frozen=True)
class MetricsConfig:
    wandb: bool = True
    wandb_project: str = "zerokl"
    wandb_mode: str | None = None  # null: WANDB_MODE, else online when logged in, else offline


@dataclass(frozen=True)
class RecipeConfig:
    name: str = "grpo"
    seed: int = 0
    output_dir: str = "~/zerokl-runs"  # absolute by default: `ray job submit` runs in a temporary copy
    run_dir: str | None = None  # default: <output_dir>/<name>-<determinism>-<time>-<id>
    # canonical: rollouts and training share the canonical forward and sampling rule (KL exactly 0).
    # stock: the pipeline users run today, for comparison on the same data, model and optimizer:
    # rollouts in `off` mode (vLLM's own model class and sampler on vLLM workers), the trainer the
    # unpatched Hugging Face model (SDPA) under FSDP2, old log-probs recomputed by the trainer.
    numerics: str = "canonical"
    # split: rollout workers and trainer ranks on GPUs (or CPUs) of their own; weights by NCCL
    # broadcast. colocated: worker i and trainer rank i share bundle i (one GPU) of one placement
    # group; the engines sleep while the trainer steps and wake for the next rollout; weights by IPC.
    placement: str = "split"
    task: TaskConfig = field(default_factory=TaskConfig)
    canonical: CanonicalTreeConfig = field(default_factory=CanonicalTreeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self):
        _check_values(self)  # also on dataclasses.replace

    @classmethod
    def from_dict(cls, data: dict) -> RecipeConfig:
        """Typed and checked; sections and keys left out keep their defaults."""
        return _build(cls, data, "")

    def to_dict(self) -> dict:
        """Plain data (dicts, lists, scalars) that from_dict reads back to an equal config."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> RecipeConfig:
    """The defaults, under the YAML file at `path`, under the `a.b.c=value` overrides."""
    data = {}
    if path is not None:
        with open(path) as f:
            data = coerce_numbers(yaml.safe_load(f) or {})
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping, got {data!r}")
    for item in overrides:
        apply_override(data, item)
    return RecipeConfig.from_dict(data)


# YAML 1.1 (PyYAML) reads "1e-6" as a string; numbers in scientific notation are meant as floats.
_SCIENTIFIC = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def coerce_numbers(node):
    if isinstance(node, dict):
        return {k: coerce_numbers(v) for k, v in node.items()}
    if isinstance(node, list):
        return [coerce_numbers(v) for v in node]
    if isinstance(node, str) and _SCIENTIFIC.match(node.strip()):
        return float(node)
    return node


def apply_override(data: dict, item: str) -> None:
    """`a.b.c=value` into raw config data, value parsed as YAML (numbers, booleans, lists, null)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    try:
        node[parts[-1]] = coerce_numbers(yaml.safe_load(raw)) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key.strip()}: the value {raw!r} is not YAML ({e.problem})") from e


# -- reading and checking ----------------------------------------------------------------------------

_KINDS = {int: "an int", float: "a float", str: "a string", bool: "true or false", dict: "a mapping",
          list: "a list"}


def _build(cls, data, path: str):
    """An instance of the dataclass `cls` from a mapping, each value checked against its field's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'the config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {path + '.' if path else ''}{close[0]}?)" if close else ""
            raise ConfigError(f"{dotted}: unknown key{hint}; known: {', '.join(names)}")
        if dotted == "rollout.determinism" and value is False:
            value = "off"  # YAML 1.1 reads a bare `off` as false
        values[key] = _convert(value, hints[key], dotted)
    return cls(**values)


def _convert(value, hint, path: str):
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    kind = typing.get_origin(hint) or hint
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # `lr: 1` means 1.0
    if isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool):
        if kind is list and typing.get_args(hint):
            return [_convert(v, typing.get_args(hint)[0], f"{path}[{i}]") for i, v in enumerate(value)]
        return value
    expected = _KINDS.get(kind, kind.__name__)
    raise ConfigError(f"{path} must be {expected}{' or null' if optional else ''}, got {value!r}")


def _check_values(cfg: RecipeConfig) -> None:
    """Checks beyond the types: allowed values and how settings fit together."""
    def one_of(path: str, value, allowed) -> None:
        if value not in allowed:
            raise ConfigError(f"{path} must be one of {', '.join(map(str, allowed))}, got {value!r}")

    t, m, r, tr, train = cfg.task, cfg.model, cfg.rollout, cfg.trainer, cfg.train
    one_of("task.kind", t.kind, TASK_KINDS)
    one_of("model.source", m.source, MODEL_SOURCES)
    if m.source == "hf" and not m.name:
        raise ConfigError("model.name is required when model.source is hf")
    if m.arch is not None:
        one_of("model.arch", m.arch, ARCHITECTURES)
    width = cfg.canonical.tree_segments
    if width is not None and (width not in TREE_WIDTHS or isinstance(width, bool)):
        raise ConfigError(f"canonical.tree_segments must be one of {TREE_WIDTHS} or null, got {width!r}")
    one_of("rollout.determinism", r.determinism, DETERMINISM_MODES)
    if r.n < 2:
        raise ConfigError("rollout.n must be >= 2: group-normalised advantages need several samples per prompt")
    one_of("trainer.device", tr.device, TRAINER_DEVICES)
    one_of("warmup.device", cfg.warmup.device, TRAINER_DEVICES)
    one_of("trainer.old_logprobs", tr.old_logprobs, OLD_LOGPROBS)
    one_of("numerics", cfg.numerics, NUMERICS)
    one_of("placement", cfg.placement, PLACEMENTS)
    if cfg.numerics == "stock" and tr.old_logprobs != "recompute":
        # stock rollouts' log-probs are not the trainer's: the ratio's denominator must be recomputed
        raise ConfigError("numerics: stock needs trainer.old_logprobs=recompute (stock rollout log-probs "
                          "differ from the trainer's)")
    if cfg.numerics == "stock" and r.determinism != "off":
        raise ConfigError("numerics: stock runs rollout.determinism=off (the stock engines); got "
                          f"{r.determinism!r}")
    if cfg.placement == "colocated" and r.num_workers != tr.num_ranks:
        raise ConfigError(f"placement: colocated puts one rollout worker next to each trainer rank: "
                          f"rollout.num_workers ({r.num_workers}) must equal trainer.num_ranks ({tr.num_ranks})")
    one_of("trainer.weight_sync", tr.weight_sync, WEIGHT_TRANSPORTS)
    if r.start_timeout_s <= 0:
        raise ConfigError("rollout.start_timeout_s must be > 0")
    if tr.weight_bucket_mb < 1:
        raise ConfigError("trainer.weight_bucket_mb must be >= 1")
    if tr.num_ranks < 1 or tr.mini_batches < 1:
        raise ConfigError("trainer.num_ranks and trainer.mini_batches must be >= 1")
    if train.prompts_per_step % tr.mini_batches:
        raise ConfigError("train.prompts_per_step must be divisible by trainer.mini_batches")
