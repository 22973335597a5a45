"""The completion budgets a config draws for its steps: the list, its summary and a histogram."""
from __future__ import annotations

import statistics

from recipes.config import RecipeConfig


def drawn_lengths(cfg: RecipeConfig) -> list[int]:
    """The max_tokens of every request a new run of `cfg` sends in its train.steps steps, drawn by the
    recipe's own functions (the task's prompt order, recipes.rollouts.group_requests)."""
    from recipes.rollouts import group_requests, prompt_indices
    from recipes.task import build_task
    task = build_task(cfg)
    per_step = cfg.train.prompts_per_step
    lengths = []
    for step in range(1, cfg.train.steps + 1):
        indices = prompt_indices((step - 1) * per_step, per_step, len(task.dataset), cfg.seed)
        _, params = group_requests([task.dataset[i]["prompt_ids"] for i in indices], indices, step, cfg.rollout,
                                   cfg.seed, task.stop_token_ids)
        lengths += [p.max_tokens for p in params]
    return lengths


def length_summary(cfg: RecipeConfig, lengths: list[int]) -> dict:
    r = cfg.rollout
    return {"distribution": r.length_distribution, "median_set": r.length_median, "sigma": r.length_sigma,
            "cap": r.max_tokens, "steps": cfg.train.steps, "count": len(lengths),
            "median": statistics.median(lengths), "min": min(lengths), "max": max(lengths),
            "at_cap": sum(n == r.max_tokens for n in lengths) / len(lengths)}


def plot_lengths(cfg: RecipeConfig, lengths: list[int], path: str) -> str:
    """A histogram of drawn completion budgets; returns its title, which states the distribution and its
    parameters."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    r, summary = cfg.rollout, length_summary(cfg, lengths)
    if r.length_distribution == "lognormal":
        law = f"lognormal: median {r.length_median}, sigma {r.length_sigma:g}, cap {r.max_tokens}"
    else:
        law = f"fixed: every request {r.max_tokens}"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=min(60, max(1, len(set(lengths)))), color="tab:blue")
    ax.axvline(summary["median"], color="black", linestyle="--", label=f"median drawn {summary['median']:g}")
    ax.set_xlabel("completion budget (max_tokens), tokens")
    ax.set_ylabel("requests")
    title = (f"{law}\n{len(lengths)} requests over {cfg.train.steps} steps "
             f"({cfg.train.prompts_per_step} prompts x {r.n}); {summary['at_cap']:.1%} at the cap")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return title
