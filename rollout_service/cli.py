"""`zerokl` command line: `zerokl audit` runs the determinism audit on a model."""
from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from rollout_service.audit import format_table, run_audit
from rollout_service.engine.decode_policy import VERIFIED_DECODE
from rollout_service.engine.engine import Engine
from rollout_service.engine.model_loading import load_model


def audit(args) -> int:
    model = load_model(args.model, args.device)
    make = lambda **kw: Engine(model, fast_path=args.fast_path, device=args.device,  # noqa: E731
                               copy_model=False, verified_decode=args.verified_decode, **kw)
    results = run_audit(make, model.config.vocab_size, tests=args.tests.split(","), modes=args.modes.split(","),
                        max_tokens=args.max_tokens, progress=True)
    Console().print(format_table(results))
    if args.json:
        print(json.dumps([r.__dict__ for r in results]))
    bad = [r for r in results if r.mode != "off" and not r.deterministic]
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="zerokl")
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("audit", help="count distinct outputs per prompt across batch/order/engine variations")
    a.add_argument("--model", default="tiny:qwen2", help="local HF checkpoint dir, or tiny:{llama,qwen2,qwen3}")
    a.add_argument("--fast-path", default="native", choices=["native", "vllm"])
    a.add_argument("--device", default="cpu")
    a.add_argument("--verified-decode", default="auto", choices=VERIFIED_DECODE,
                   help="how verified requests decode (dvr: always propose and verify)")
    a.add_argument("--tests", default="single,mixed,prefix")
    a.add_argument("--modes", default="verified,invariant,off")
    a.add_argument("--max-tokens", type=int, default=12)
    a.add_argument("--json", action="store_true", help="also print the results as JSON")
    a.set_defaults(func=audit)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
