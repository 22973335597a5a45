"""Benchmarks: run as modules from the repo root, e.g. `python -m bench.kernels` (prints JSON)."""
from __future__ import annotations

import json


def emit(doc: dict, out: str | None = None) -> None:
    """Print a benchmark's JSON document, and write it to `out` as well when given."""
    text = json.dumps(doc, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
