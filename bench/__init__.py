"""Benchmarks: run as modules from the repo root, e.g. `python -m bench.kernels` (prints JSON)."""
from __future__ import annotations

import json


def write_doc(doc: dict, out: str) -> None:
    """Write a benchmark's JSON document to `out`."""
    with open(out, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")


def emit(doc: dict, out: str | None = None) -> None:
    """Print a benchmark's JSON document, and write it to `out` as well when given."""
    print(json.dumps(doc, indent=1))
    if out:
        write_doc(doc, out)
