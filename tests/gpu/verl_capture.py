"""Records, inside verl's workers, each micro-batch the integration scores next to the rollout's log-probs of it.

Loaded by verl itself in every process (VERL_USE_EXTERNAL_MODULES=verl_capture, this folder on PYTHONPATH) when
test_verl_quickstart_gpu.py sets ZEROKL_VERL_CAPTURE to a folder: every canonical_forward_step whose micro-batch
carries verl's `rollout_log_probs` saves (input ids, their offsets, the rollout's log-probs, the response mask,
the integration's log-probs) there, so a nonzero difference can be read token by token (`compare`).
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

ENV = "ZEROKL_VERL_CAPTURE"
_count = itertools.count()


def _install() -> None:
    from rollout_service.integrations.verl import actor
    original = actor.canonical_forward_step
    if getattr(original, "_captures", False):
        return

    def canonical_forward_step(engine, micro_batch, loss_function, forward_only):
        loss, out = original(engine, micro_batch, loss_function, forward_only)
        if "rollout_log_probs" in micro_batch.keys() and forward_only:
            ids = micro_batch["input_ids"]
            record = dict(values=ids.values().cpu(), offsets=ids.offsets().cpu(),
                          rollout=micro_batch["rollout_log_probs"].float().cpu(),
                          response_mask=micro_batch["response_mask"].cpu(),
                          ours=out["model_output"]["log_probs"].values().float().cpu())
            torch.save(record, Path(os.environ[ENV]) / f"{os.getpid()}-{next(_count)}.pt")
        return loss, out

    canonical_forward_step._captures = True
    actor.canonical_forward_step = canonical_forward_step


def compare(folder: Path) -> dict:
    """Over every recorded micro-batch: tokens compared, tokens whose bits differ, the max |p_rollout - p_ours|,
    and how many differing tokens are each sequence's first (scored from the prompt's prefill)."""
    tokens = differ = first = 0
    worst = 0.0
    for path in sorted(folder.glob("*.pt")):
        r = torch.load(path, weights_only=False)  # our own records (nested tensors inside)
        offsets = r["offsets"].tolist()
        rollout = [t for t in (r["rollout"].unbind() if r["rollout"].is_nested else r["rollout"])]
        masks = [t for t in (r["response_mask"].unbind() if r["response_mask"].is_nested else r["response_mask"])]
        for i in range(len(offsets) - 1):
            n_resp = int(masks[i].sum())
            length = offsets[i + 1] - offsets[i]
            start = offsets[i] + length - n_resp - 1  # the position that scores the first response token
            ours = r["ours"][start:start + n_resp]
            theirs = rollout[i][:n_resp].float()
            bad = ours.view(torch.int32) != theirs.contiguous().view(torch.int32)
            tokens += n_resp
            differ += int(bad.sum())
            first += int(bool(bad[:1].any()))
            if n_resp:
                worst = max(worst, float((ours.exp() - theirs.exp()).abs().max()))
    return dict(files=len(list(folder.glob("*.pt"))), tokens=tokens, differ=differ, first_token_differs=first,
                max_prob_diff=worst)


if os.environ.get(ENV):
    _install()
