"""Batch generation over any engine's step loop (add_request / step): rollouts in request order."""
from __future__ import annotations

from rollout_service.params import InvalidRequestError, Rollout, check_batch


def generate_in_order(engine, prompts, params, use_tqdm: bool = False) -> list[Rollout]:
    """Drive any engine (add_request / step) until every request finishes; rollouts in request order,
    a request the engine refuses gets finish_reason 'error'. `params`: one SamplingParams or a list."""
    check_batch(prompts, params)
    params_list = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
    results: dict[int, Rollout] = {}
    order: list[int | Rollout] = []
    for prompt, p in zip(prompts, params_list):
        try:
            order.append(engine.add_request(prompt, p))
        except (InvalidRequestError, TypeError, ValueError) as err:
            order.append(Rollout(list(prompt) if isinstance(prompt, (list, tuple)) else [],
                                 finish_reason="error", error=str(err)))
    pending = {x for x in order if isinstance(x, int)}
    progress = None
    if use_tqdm:
        from tqdm.auto import tqdm
        progress = tqdm(total=len(pending), desc="rollouts")
    while pending:  # per step: only the finished requests are looked at
        for rid, rollout in engine.step():
            results[rid] = rollout
            if rid in pending:
                pending.discard(rid)
                if progress is not None:
                    progress.update(1)
    if progress is not None:
        progress.close()
    return [results[x] if isinstance(x, int) else x for x in order]
