"""Recipe configuration: typed sections whose field defaults are the recipe's defaults, read from a
YAML file and `key.sub=value` overrides, and checked once, with every error naming its dotted key.

    cfg = load_config("recipes/configs/tiny.yaml", ["trainer.lr=2e-3"])
    cfg.rollout.n, cfg.trainer.lr          # typed attributes
    cfg.to_dict()                          # plain data: wandb, the run's config.yaml (to_yaml)
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kernels import TREE_WIDTHS
from rollout_service.params import DETERMINISM_MODES
from rollout_service.tiny_models import ARCHITECTURES
from rollout_service.service.switch_modes import SWITCH_MODES
from rollout_service.service.weight_sync import TRANSPORTS

TASK_KINDS = ("tiny", "gsm8k")
MODEL_SOURCES = ("tiny", "hf")
OLD_LOGPROBS = ("rollout", "recompute")
TRAINER_DEVICES = ("cpu", "cuda")
NUMERICS = ("canonical", "stock")
PLACEMENTS = ("split", "colocated")
WEIGHT_TRANSPORTS = ("auto", *TRANSPORTS)
LENGTH_DISTRIBUTIONS = ("fixed", "lognormal")


class ConfigError(ValueError):
    """A bad recipe config; the message names the key by its dotted path."""


@dataclass(frozen=True)
class TaskConfig:
    """The `task` section: the prompts the policy answers and the reward its completions get."""
    kind: str = "tiny"
    """Which task: tiny (the built-in arithmetic problems) | gsm8k."""
    max_operand: int = 19
    """tiny: problems "a<op>b=" with 0 <= a, b <= max_operand."""
    ops: str = "+"
    """tiny: the operators, each a character of "+-*"; "-" makes only the problems with b <= a."""
    split: str = "train"
    """gsm8k: the split to read: the hub's, or <split>.jsonl in the directory `path`."""
    path: str | None = None
    """gsm8k: a directory of <split>.jsonl files, or one JSONL file; null: the hub's openai/gsm8k (main)."""
    max_prompt_tokens: int | None = None
    """gsm8k: prompts longer than this many tokens are dropped; null (or 0) keeps all."""
    stop_token_ids: list[int] = field(default_factory=list)
    """gsm8k: more token ids that end a rollout, besides EOS and the chat end-of-turn tokens."""


@dataclass(frozen=True)
class ModelConfig:
    """The `model` section: the policy's starting weights (and the tokenizer of the gsm8k task)."""
    source: str = "tiny"
    """tiny (a random model made by the project) | hf (a hub id or local checkpoint in `name`)."""
    name: str | None = None
    """hf: the hub id or local checkpoint directory (required); also gsm8k's tokenizer unless `tokenizer`."""
    tokenizer: str | None = None
    """gsm8k: the tokenizer's hub id or local directory, when it is not `name`'s; null: `name`."""
    # tiny: rollout_service.tiny_models options; null keeps that module's default
    arch: str | None = None
    """tiny: the architecture, llama | qwen2 | qwen3 | qwen3_moe."""
    hidden_size: int | None = None
    """tiny: the hidden size (model width)."""
    num_layers: int | None = None
    """tiny: the number of decoder layers."""
    num_heads: int | None = None
    """tiny: the number of attention (query) heads."""
    num_kv_heads: int | None = None
    """tiny: the number of key/value heads (fewer than num_heads: grouped-query attention)."""
    intermediate_size: int | None = None
    """tiny: the MLP's intermediate width (qwen3_moe: each expert's is half of it)."""
    max_positions: int | None = None
    """tiny: max_position_embeddings, the engines' default max_model_len."""
    head_dim: int | None = None
    """tiny, qwen3 and qwen3_moe: the attention head width; null: hidden_size / num_heads (Qwen3-4B: 128)."""
    tie_word_embeddings: bool | None = None
    """tiny: the lm head shares the embedding's weight (Qwen3-4B and smaller Qwen models do)."""
    vocab_size: int | None = None
    """tiny: logits width, >= the tokenizer's; null: the tokenizer's; more: a real model's (benchmarks)."""

    def tiny_options(self) -> dict:
        """The tiny model's keyword options that are set."""
        names = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "max_positions", "head_dim", "tie_word_embeddings")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


@dataclass(frozen=True)
class CanonicalTreeConfig:
    """The `canonical` section: the canonical forward's row-parallel segment tree."""
    tree_segments: int | None = None
    """Tree width, 1, 2, 4 or 8: the largest TP degree that reproduces the trainer; null: ZEROKL_TREE_SEGMENTS
    or 8. Given to every rollout worker and trainer rank; the run's config.yaml records the width used."""


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised steps on the task's answers before GRPO (0 = none); skipped when resuming."""
    steps: int = 0
    """AdamW steps of the warm-up; 0: no warm-up."""
    lr: float = 3e-3
    """The warm-up's AdamW learning rate (no weight decay)."""
    batch_size: int = 64
    """(prompt, answer) examples per step, drawn at random with replacement from the whole task (seeded)."""
    device: str = "cpu"
    """cpu | cuda (the driver's GPU, before the workers and ranks start)."""


@dataclass(frozen=True)
class RolloutConfig:
    """The `rollout` section: the pool of rollout workers and how each rollout is sampled."""
    num_workers: int = 2
    """Rollout workers (Ray actors, one engine each) in the pool; colocated: equal to trainer.num_ranks."""
    pool_name: str | None = None
    """The pool's Ray actor name; null: grpo-<random hex>, unique per run."""
    engine: dict = field(default_factory=dict)
    """Every worker's engine options, forwarded verbatim: EngineConfig and ParallelConfig fields, or a vLLM
    engine's; RolloutWorker / EngineConfig check them."""
    resources_per_worker: dict = field(default_factory=lambda: {"num_cpus": 1})
    """Ray actor options of each worker, forwarded verbatim (e.g. {num_cpus: 2, num_gpus: 1})."""
    start_timeout_s: float = 120.0
    """Seconds a worker may take to build its engine (> 0); a stock vLLM engine compiles its graphs (inductor)
    on first start, which on a fresh GPU machine takes minutes."""
    determinism: str = "verified"
    """Every request's determinism mode: verified | invariant | off (numerics stock: off)."""
    n: int = 8
    """Samples per prompt (the GRPO group), each with its own seed; at least 2."""
    max_tokens: int = 16
    """Most tokens generated per rollout; with length_distribution lognormal, the cap of every drawn budget."""
    length_distribution: str = "fixed"
    """Each request's max_tokens: fixed (every request rollout.max_tokens) | lognormal (drawn per request,
    median length_median, log-space std length_sigma, clipped to [1, max_tokens]): completions whose
    lengths vary inside a batch as reasoning rollouts' do. A draw is a pure function of (run seed, step,
    prompt index, sample index), like the sampling seed (recipes.rollouts.completion_budget)."""
    length_median: int | None = None
    """lognormal: the median drawn max_tokens, 1 .. max_tokens (required there)."""
    length_sigma: float = 0.7
    """lognormal: the std of the budget's logarithm, >= 0; 0.7 puts a 10x spread between the 5th and 95th
    percentiles (exp(2 x 1.645 x 0.7) = 10)."""
    temperature: float = 1.0
    """Sampling temperature, >= 0 (0: greedy); the trainer's log-probs use it too (0: 1.0 there)."""
    top_k: int = -1
    """Top-k sampling; -1 or 0: off."""
    top_p: float = 1.0
    """Top-p (nucleus) sampling, in (0, 1]; 1.0: off."""
    sleep_while_training: bool = True
    """placement colocated: the engines release their memory (vLLM's sleep mode) while the trainer steps,
    and wake for the next push. false keeps them awake and holding it (TRL colocate's default; verl's
    free_cache_engine: false): no sleep and no wake in the step, where the GPU has memory for both."""
    return_routed_experts: bool | None = None
    """Record each token's MoE routing and log rollout_train/routing_agreement; null: on for MoE policies on
    native-engine workers without TP (recipes.rollouts.records_routing)."""


@dataclass(frozen=True)
class TrainerConfig:
    """The `trainer` section: the FSDP2 trainer ranks, their optimizer and loss, and the weight pushes."""
    num_ranks: int = 2
    """Trainer ranks (Ray actors, one torch.distributed process group), at least 1."""
    device: str = "cpu"
    """cpu (gloo) | cuda (NCCL, one GPU per rank)."""
    resources_per_rank: dict = field(default_factory=lambda: {"num_cpus": 1})
    """Ray actor options of each rank, forwarded; colocated on GPUs: num_gpus, a share below 1."""
    placement_strategy: str = "PACK"
    """Ray placement-group strategy for GPU ranks (split placement) and for the colocated bundles."""
    torch_threads: int = 1
    """torch.set_num_threads on each rank; 0: 1."""
    lr: float = 1e-4
    """AdamW learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas, [beta1, beta2]."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float | None = 1.0
    """Gradient-norm clipping threshold; null or 0: no clipping."""
    clip_low: float = 0.2
    """PPO clip: the probability ratio is clamped below at 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip: the probability ratio is clamped above at 1 + clip_high."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch, at least 1; train.prompts_per_step must be divisible by it."""
    micro_batch_size: int = 0
    """Sequences per forward on a rank; 0 = all at once. Unused when max_tokens_per_micro_batch is set."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward on a rank (verl's ppo_max_token_len_per_gpu): whole sequences are grouped
    into micro-batches of at most this many tokens (recipes.batch.budget_groups); 0: micro_batch_size rules.
    At least the longest prompt + rollout.max_tokens. Log-probs keep their bits whatever the budget; the
    gradient is a sum over micro-batches, whose order of summation (and so its last bits) follows them."""
    packing: bool = True
    """Each micro-batch's sequences go back to back in one row, positions restarting per sequence (no pad
    token in any matmul or attention); false: right-padded rows. Log-probs are the same bits either way."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (long sequences);
    the forward's values, and so the log-probs, do not change."""
    old_logprobs: str = "rollout"
    """rollout (the rollouts' own) | recompute (the trainer's, before the update; numerics stock needs it)."""
    scale_advantages: bool = True
    """Divide advantages by the group's std (GRPO); False = mean-centred only."""
    weight_sync: str = "auto"
    """How weights reach the workers (rollout_service.service.weight_sync): auto | object_store | broadcast |
    ipc. auto: ipc if they share rank 0's GPU, broadcast if they have GPUs of their own, else object_store."""
    weight_bucket_mb: int = 256
    """Bucket size of broadcast / ipc pushes, in MiB; at least 1."""
    weight_stage_mb: int = 8192
    """Broadcast / ipc pushes whose bf16 weights fit in this many MiB are staged whole on rank 0's device:
    the weights are read once, not twice, and ipc workers take the push in one call. 0 = always in buckets."""
    weight_switch: str = "drain"
    """When a push takes effect for rollouts in flight (rollout_service/service/switch_modes.py): drain |
    finish-then-switch | switch-in-flight (native engines); other than drain needs weight_sync object_store."""
    weight_push_timeout_s: float = 300.0
    """How long a broadcast or ipc push's workers wait on its sender (WeightSender timeout_s); past it
    they give the push up and restart, keeping the weights they had."""
    arm_weight_push: bool = True
    """A broadcast or ipc push that follows a train step (synchronous steps) is armed as the step starts:
    the pool drains and its workers wait for it while the ranks train (weight_sync.WeightSender.arm), so
    the pool's begin is off the step's path; a sleeping engine still wakes only once the step's last
    backward has run (asked by rank 0, by ipc). Meanwhile the pool serves no request (the recipe sends
    none then). A step that outlasts half of weight_push_timeout_s has its armed push declined (the
    workers go back to serving), and the push after it goes unarmed."""


@dataclass(frozen=True)
class TrainLoopConfig:
    """The `train` section: how many steps, how many prompts each, and what is saved."""
    steps: int = 10
    """GRPO steps of the run (a resumed run continues up to this step)."""
    prompts_per_step: int = 8
    """Prompts per step, each sampled rollout.n times; divisible by trainer.mini_batches."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    save_final: bool = True
    """Checkpoint the last step (benchmarks turn it off: it is no step's work)."""
    save_rollouts: bool = False
    """Write every step's rollouts and rewards to <run_dir>/rollouts/step_NNNNNN.jsonl."""
    async_steps: int = 0
    """k > 0: the rollouts of steps s+1 .. s+k are generated while the trainer does step s (placement split,
    numerics canonical, trainer.old_logprobs rollout); 0: each step's rollouts, then its update."""


@dataclass(frozen=True)
class MetricsConfig:
    """The `metrics` section: wandb logging (<run_dir>/metrics.jsonl is written either way)."""
    wandb: bool = True
    """Log every step's numeric metrics (and the config) to wandb."""
    wandb_project: str = "zerokl"
    """The wandb project."""
    wandb_mode: str | None = None
    """wandb's mode (e.g. online, offline; disabled: no wandb run); null: WANDB_MODE, else online when logged
    in, else offline."""


@dataclass(frozen=True)
class RecipeConfig:
    """The whole YAML recipe config: run-level keys, then one section per part of the run."""
    name: str = "grpo"
    """Run name: a new run directory's name and the wandb run's start with <name>-<determinism>."""
    seed: int = 0
    """Run seed: tiny model weights, tiny task order, prompt order, sampling seeds, warm-up batches."""
    output_dir: str = "~/zerokl-runs"
    """Where new run directories go; absolute by default: `ray job submit` runs in a temporary copy."""
    run_dir: str | None = None
    """The run's directory (config.yaml, metrics, checkpoints); null: a resumed checkpoint's run, else
    <output_dir>/<name>-<determinism>-<time>-<id>."""
    # canonical: rollouts and training share the canonical forward and sampling rule (KL exactly 0).
    # stock: the pipeline users run today, for comparison on the same data, model and optimizer:
    # rollouts in `off` mode (vLLM's own model class and sampler on vLLM workers), the trainer the
    # unpatched Hugging Face model (SDPA) under FSDP2, old log-probs recomputed by the trainer.
    numerics: str = "canonical"
    """canonical | stock; stock needs rollout.determinism=off and trainer.old_logprobs=recompute."""
    # split: rollout workers and trainer ranks on GPUs (or CPUs) of their own; weights by NCCL
    # broadcast. colocated: worker i and trainer rank i share bundle i (one GPU) of one placement
    # group; the engines sleep while the trainer steps and wake for the next rollout (unless
    # rollout.sleep_while_training is false); weights by IPC.
    placement: str = "split"
    """split | colocated; colocated needs rollout.num_workers == trainer.num_ranks."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The `task` section: prompts and reward."""
    canonical: CanonicalTreeConfig = field(default_factory=CanonicalTreeConfig)
    """The `canonical` section: the canonical forward's segment tree."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The `model` section: the policy's starting weights."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """The `warmup` section: supervised steps before GRPO."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The `rollout` section: the worker pool and sampling."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The `trainer` section: FSDP2 ranks, optimizer, loss, weight pushes."""
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    """The `train` section: steps, prompts per step, checkpoints."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The `metrics` section: wandb logging."""

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
    data = {} if path is None else read_config_file(path)
    for item in overrides:
        apply_override(data, item)
    return RecipeConfig.from_dict(data)


SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def read_config_file(path: str | Path) -> dict:
    """A config file's raw data; a missing file is named with the configs that ship, a broken one with
    YAML's reason (ConfigError either way: the CLI prints it, no traceback)."""
    path = Path(path)
    if not path.is_file():
        shipped = ", ".join(f"recipes/configs/{p.name}" for p in sorted(SHIPPED_CONFIGS.glob("*.yaml")))
        raise ConfigError(f"{path}: no such config file; the configs that ship: {shipped}")
    try:
        with open(path) as f:
            data = coerce_numbers(yaml.safe_load(f) or {})
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping, got {data!r}")
    return data


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


# The range of every numeric field: (test, the range in words). Rule: a value the run cannot use is refused
# at load, naming its key, not steps later inside a Ray actor. The tests are comparisons that NaN fails;
# a null (optional) value is not checked; a key ending in [] is each element of a list.
POSITIVE = (lambda v: v > 0, "> 0")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
NUMERIC_RANGES = {
    "seed": NON_NEGATIVE,
    "task.max_operand": NON_NEGATIVE,
    "task.max_prompt_tokens": NON_NEGATIVE,
    "task.stop_token_ids[]": NON_NEGATIVE,
    **{f"model.{k}": AT_LEAST_1 for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                          "intermediate_size", "max_positions", "head_dim", "vocab_size")},
    "warmup.steps": NON_NEGATIVE,
    "warmup.lr": POSITIVE,
    "warmup.batch_size": AT_LEAST_1,
    "rollout.num_workers": AT_LEAST_1,
    "rollout.start_timeout_s": POSITIVE,
    "rollout.n": (lambda v: v >= 2, ">= 2: group-normalised advantages need several samples per prompt"),
    "rollout.max_tokens": AT_LEAST_1,
    "rollout.length_median": AT_LEAST_1,
    "rollout.length_sigma": NON_NEGATIVE,
    "rollout.temperature": NON_NEGATIVE,
    "rollout.top_k": (lambda v: v >= -1, ">= -1 (-1 or 0: off)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "in (0, 1] (1: off)"),
    "trainer.num_ranks": AT_LEAST_1,
    "trainer.torch_threads": NON_NEGATIVE,
    "trainer.lr": POSITIVE,
    "trainer.betas[]": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "trainer.weight_decay": NON_NEGATIVE,
    "trainer.max_grad_norm": NON_NEGATIVE,
    "trainer.clip_low": NON_NEGATIVE,
    "trainer.clip_high": NON_NEGATIVE,
    "trainer.mini_batches": AT_LEAST_1,
    "trainer.micro_batch_size": NON_NEGATIVE,
    "trainer.max_tokens_per_micro_batch": NON_NEGATIVE,
    "trainer.weight_bucket_mb": AT_LEAST_1,
    "trainer.weight_stage_mb": NON_NEGATIVE,
    "trainer.weight_push_timeout_s": POSITIVE,
    "train.steps": AT_LEAST_1,
    "train.prompts_per_step": AT_LEAST_1,
    "train.save_every": NON_NEGATIVE,
    "train.async_steps": NON_NEGATIVE,
}


def _values_at(cfg: RecipeConfig, key: str) -> list[tuple[str, object]]:
    """(dotted path, value) of a NUMERIC_RANGES key: the field's value, or each element of a `key[]` list."""
    name = key.removesuffix("[]")
    value = cfg
    for part in name.split("."):
        value = getattr(value, part)
    if key.endswith("[]"):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [(name, value)]


def _check_ranges(cfg: RecipeConfig) -> None:
    if len(cfg.trainer.betas) != 2:
        raise ConfigError(f"trainer.betas must be [beta1, beta2], got {cfg.trainer.betas!r}")
    for key, (in_range, allowed) in NUMERIC_RANGES.items():
        for path, value in _values_at(cfg, key):
            if value is None:
                continue
            if isinstance(value, float) and math.isinf(value):
                raise ConfigError(f"{path} must be finite, got {value!r}")
            if not in_range(value):
                raise ConfigError(f"{path} must be {allowed}, got {value!r}")


def _check_values(cfg: RecipeConfig) -> None:
    """Checks beyond the types: allowed values and how settings fit together."""
    def one_of(path: str, value, allowed) -> None:
        if value not in allowed:
            raise ConfigError(f"{path} must be one of {', '.join(map(str, allowed))}, got {value!r}")

    _check_ranges(cfg)  # first: the checks below divide by and compare these values
    t, m, r, tr, train = cfg.task, cfg.model, cfg.rollout, cfg.trainer, cfg.train
    one_of("task.kind", t.kind, TASK_KINDS)
    one_of("model.source", m.source, MODEL_SOURCES)
    if m.source == "hf" and not m.name:
        raise ConfigError("model.name is required when model.source is hf")
    if m.arch is not None:
        one_of("model.arch", m.arch, ARCHITECTURES)
    if m.head_dim is not None and m.arch not in ("qwen3", "qwen3_moe"):
        raise ConfigError(f"model.head_dim is a qwen3 / qwen3_moe option (llama and qwen2 take hidden_size / "
                          f"num_heads); got model.arch {m.arch!r}")
    width = cfg.canonical.tree_segments
    if width is not None and (width not in TREE_WIDTHS or isinstance(width, bool)):
        raise ConfigError(f"canonical.tree_segments must be one of {TREE_WIDTHS} or null, got {width!r}")
    one_of("rollout.determinism", r.determinism, DETERMINISM_MODES)
    one_of("rollout.length_distribution", r.length_distribution, LENGTH_DISTRIBUTIONS)
    if r.length_distribution == "lognormal":
        if r.length_median is None or not 1 <= r.length_median <= r.max_tokens:
            raise ConfigError(f"rollout.length_median must be in 1 .. rollout.max_tokens ({r.max_tokens}) when "
                              f"rollout.length_distribution is lognormal, got {r.length_median!r}")
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
    one_of("trainer.weight_switch", tr.weight_switch, SWITCH_MODES)
    if tr.weight_switch != "drain" and tr.weight_sync != "object_store":
        raise ConfigError(f"trainer.weight_switch={tr.weight_switch} needs trainer.weight_sync=object_store "
                          f"(bucketed pushes switch in drain mode only), got {tr.weight_sync!r}")
    if train.async_steps and (cfg.placement != "split" or cfg.numerics != "canonical"
                              or tr.old_logprobs != "rollout"):
        # colocated engines sleep while the trainer steps; the stock arm's and a recomputed denominator
        # are not the behaviour policy's log-probs
        raise ConfigError("train.async_steps > 0 needs placement split, numerics canonical and "
                          "trainer.old_logprobs rollout")
    if train.prompts_per_step % tr.mini_batches:
        raise ConfigError("train.prompts_per_step must be divisible by trainer.mini_batches")
