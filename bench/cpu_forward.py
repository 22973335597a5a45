"""Cost of the canonical forward vs the unpatched Hugging Face forward on CPU (tiny models).

Prints JSON: milliseconds per forward for each architecture and batch shape, and the ratio.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import trainer_patch
from recipes.tiny_models import tiny_model


def _time(fn, repeats):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for arch in ("llama", "qwen2", "qwen3"):
        for batch, seq in ((1, 64), (8, 64), (32, 128)):
            ids = torch.randint(0, 96, (batch, seq))
            plain = tiny_model(arch)
            patched = trainer_patch.patch_model(tiny_model(arch))
            with torch.no_grad():
                t_plain = _time(lambda: plain(input_ids=ids), args.repeats)
                t_canon = _time(lambda: patched(input_ids=ids), args.repeats)
            rows.append(dict(arch=arch, batch=batch, seq=seq, unpatched_ms=round(t_plain, 2),
                             canonical_ms=round(t_canon, 2), ratio=round(t_canon / t_plain, 2)))
    print(json.dumps(dict(device="cpu", threads=torch.get_num_threads(), results=rows), indent=1))


if __name__ == "__main__":
    main()
