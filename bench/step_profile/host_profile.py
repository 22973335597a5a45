"""The default view: the synchronising call sites of a generate, and cProfile's listing with source
paths as the import path sees them."""
from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings


def sync_sites(run) -> collections.Counter:
    """Distinct Python stacks (innermost frames) of synchronising torch calls made during run()."""
    import torch
    sites: collections.Counter = collections.Counter()
    if not torch.cuda.is_available():  # the sync debug mode exists for CUDA only
        run()
        return sites
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename][-4:]
        sites[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames))] += 1

    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    return sites


def import_relative(text: str) -> str:
    """Source paths as seen from the import path (vllm/v1/..., rollout_service/...): the report names
    modules, not where this machine installed them."""
    roots = {r for p in sys.path if p and os.path.isdir(p) for r in (p.rstrip(os.sep), os.path.normpath(p))}
    for root in sorted(roots, key=len, reverse=True):
        text = text.replace(root + os.sep, "")
    return text
