"""Bit comparisons shared by the multi-turn tests (test_episodes.py, test_templates.py): a segment's model
tokens against the trainer's log-probs from one forward over the segment."""
from __future__ import annotations

import struct

import torch

import trainer_patch


def bits(values) -> list[bytes]:
    """Each value's float64 bytes: equal lists mean equal bits, NaNs and signed zeros included."""
    return [struct.pack("<d", float(x)) for x in values]


def trainer_bits(trainer, seg) -> list[bytes]:
    """The trainer's log-probs of a segment's model tokens, from one forward over the segment's context."""
    with torch.no_grad():
        lp = trainer_patch.token_logprobs(trainer, torch.tensor([seg.context]))[0, len(seg.prompt_ids) - 1:]
    return bits(x for x, is_model in zip(lp.tolist(), seg.model_mask) if is_model)
