"""The whole recipe config, its run-level keys and one section per part of the run, and load_config."""
from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .checks import check_values
from .loader import apply_override, build_section, read_config_file
from .model import CanonicalTreeConfig, ModelConfig, WarmupConfig
from .renamed import move_renamed_keys
from .rollout import RolloutConfig
from .run import MetricsConfig, TrainLoopConfig
from .task import TaskConfig
from .trainer import TrainerConfig


def _plain(items) -> dict:
    """A section's fields as plain data: an enum (rollout.determinism) as its value."""
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in items}


@dataclass(frozen=True)
class RecipeConfig:
    """The whole YAML recipe config: run-level keys, then one section per part of the run."""
    name: str = "grpo"
    """Run name: a new run directory's name and the wandb run's start with <name>-<determinism>."""
    seed: int = 0
    """Run seed: tiny model weights, tiny task order, prompt order, sampling seeds, warm-up batches."""
    # Rule (several nodes): every trainer rank writes its checkpoint shards into the run directory on its
    # own node, and a resumed run reads them wherever its ranks land; so the run directory must be one
    # directory that every node mounts at the same path (a network filesystem). The job checks it before
    # anything long starts (recipes/run_storage.py: a probe file each way between the driver and every
    # rank's node) and refuses otherwise, naming the path and the node.
    output_dir: str = "~/zerokl-runs"
    """Where new run directories go; absolute by default: `ray job submit` runs in a temporary copy. On
    several nodes: a directory every node shares at this path (see the rule above)."""
    run_dir: str | None = None
    """The run's directory (config.yaml, metrics, checkpoints); null: a resumed checkpoint's run, else
    <output_dir>/<name>-<determinism>-<time>-<id>. On several nodes: shared by every node (the rule above)."""
    # canonical: rollouts and training share the canonical forward and sampling rule (KL exactly 0).
    # stock: the pipeline users run today, for comparison on the same data, model and optimizer:
    # rollouts in `off` mode (vLLM's own model class and sampler on vLLM workers), the trainer the
    # unpatched Hugging Face model (SDPA) under FSDP2, old log-probs recomputed by the trainer.
    numerics: str = "canonical"
    """canonical | stock; stock needs rollout.determinism=off and trainer.loss.old_logprobs=recompute."""
    # split: rollout workers and trainer ranks on GPUs (or CPUs) of their own; weights by NCCL
    # broadcast. Where on a cluster: each side's actor options (rollout.resources_per_worker,
    # trainer.placement.resources_per_rank: a node's custom resource places by node) and placement
    # strategies (rollout.placement_strategy, trainer.placement.strategy). colocated: worker i and trainer rank i share bundle i (one GPU) of one placement
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
    """The `trainer` section: FSDP2 ranks, placement, optimizer, loss, batching, weight pushes."""
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    """The `train` section: steps, prompts per step, checkpoints."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The `metrics` section: wandb logging."""

    def __post_init__(self):
        check_values(self)  # also on dataclasses.replace

    @classmethod
    def from_dict(cls, data: dict) -> RecipeConfig:
        """Typed and checked; sections and keys left out keep their defaults, old keys are read at their new
        place (recipes.config.renamed)."""
        return build_section(cls, move_renamed_keys(copy.deepcopy(data)))

    def to_dict(self) -> dict:
        """Plain data (dicts, lists, scalars) that from_dict reads back to an equal config."""
        return dataclasses.asdict(self, dict_factory=_plain)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> RecipeConfig:
    """The defaults, under the YAML file at `path`, under the `a.b.c=value` overrides."""
    data = {} if path is None else read_config_file(path)
    for item in overrides:
        apply_override(data, item)
    return RecipeConfig.from_dict(data)
