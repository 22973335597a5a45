"""Determinism audit, modelled on SGLang's suite: count distinct outputs per prompt under variation.

single: one prompt inside batches of 1, 4, 16, 64 requests; mixed: short and long prompts in random
compositions and arrival orders, with engines of different window / group / prefill-chunk / KV-cache
sizes (small caches force preemption and recomputation); prefix: prompts sharing prefixes of several
lengths, batched randomly. A deterministic mode has exactly one distinct output per prompt.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from rollout_service.params import DETERMINISM_MODES, Rollout, SamplingParams

ENGINE_VARIANTS = (dict(), dict(window=4, group=2), dict(window=16, group=16, max_prefill_tokens=24),
                   dict(window=8, group=3, kv_cache_tokens=512))


@dataclass
class AuditResult:
    test: str
    mode: str
    sampling: str
    prompts: int
    runs: int
    max_distinct: int  # over prompts: distinct (tokens, log-prob bits) outputs

    @property
    def deterministic(self) -> bool:
        return self.max_distinct == 1


def _key(r: Rollout) -> tuple:
    assert r.ok, r.error
    return tuple(r.token_ids), torch.tensor(r.logprobs, dtype=torch.float32).view(torch.int32).tolist().__repr__()


def _prompts(rng: random.Random, vocab: int, lengths) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _runs(test: str, rng: random.Random, vocab: int):
    """Yield (engine variant, prompts in this run, ids of the audited prompts within them)."""
    if test == "single":
        target = _prompts(rng, vocab, [12])[0]
        for i, bs in enumerate((1, 4, 16, 64)):
            fill = _prompts(rng, vocab, [rng.randint(2, 30) for _ in range(bs - 1)])
            where = rng.randrange(bs)
            yield ENGINE_VARIANTS[i % len(ENGINE_VARIANTS)], fill[:where] + [target] + fill[where:], {where: 0}
    elif test in ("mixed", "prefix"):
        if test == "mixed":
            pool = _prompts(rng, vocab, [3, 5, 40, 8, 64, 2, 25, 50])
        else:
            stem = _prompts(rng, vocab, [48])[0]
            pool = [stem[:n] + _prompts(rng, vocab, [rng.randint(1, 6)])[0] for n in (4, 12, 24, 40, 48, 48)]
        for i in range(6):
            chosen = rng.sample(range(len(pool)), rng.randint(2, len(pool)))
            yield ENGINE_VARIANTS[i % len(ENGINE_VARIANTS)], [pool[j] for j in chosen], \
                {k: j for k, j in enumerate(chosen)}
    else:
        raise ValueError(f"unknown audit test {test!r}")


def run_audit(make_engine: Callable[..., object], vocab_size: int, tests=("single", "mixed", "prefix"),
              modes=DETERMINISM_MODES, max_tokens: int = 12, seed: int = 0,
              progress: bool = False) -> list[AuditResult]:
    """make_engine(**variant) -> Engine. Returns one AuditResult per (test, mode, sampling)."""
    samplings = {"greedy": dict(temperature=0.0), "T=0.7,top_p=0.9": dict(temperature=0.7, top_p=0.9)}
    plan = [(t, m, s) for t in tests for m in modes for s in samplings]
    results = []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(plan), desc="audit")
    engines = {}
    for test, mode, sname in plan:
        rng = random.Random(f"{seed}-{test}")
        outputs: dict[int, set] = {}
        runs = 0
        for variant, prompts, audited in _runs(test, rng, vocab_size):
            key = tuple(sorted(variant.items()))
            if key not in engines:
                engines[key] = make_engine(**variant)
            params = [SamplingParams(max_tokens=max_tokens, seed=1000 + audited.get(i, i), determinism=mode,
                                     **samplings[sname]) for i in range(len(prompts))]
            rollouts = engines[key].generate(prompts, params)
            for pos, pid in audited.items():
                outputs.setdefault(pid, set()).add(_key(rollouts[pos]))
            runs += 1
        results.append(AuditResult(test, mode, sname, len(outputs), runs, max(len(v) for v in outputs.values())))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results


def format_table(results: list[AuditResult]):
    from rich.table import Table
    table = Table(title="Determinism audit: distinct outputs per prompt (1 = deterministic)")
    for col in ("test", "mode", "sampling", "prompts", "runs", "max distinct"):
        table.add_column(col)
    for r in results:
        table.add_row(r.test, r.mode, r.sampling, str(r.prompts), str(r.runs),
                      f"[green]{r.max_distinct}[/]" if r.deterministic else f"[red]{r.max_distinct}[/]")
    return table
