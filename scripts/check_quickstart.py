"""The README's Quick start, as CI runs it (see scripts/run_quickstart.sh).

    python3 scripts/check_quickstart.py extract [README.md]   # print the ```bash block under "## Quick start"
    python scripts/check_quickstart.py check RUN_OR_RUNS_DIR [--steps N]

`check` takes a run directory, or a directory holding exactly one run (~/zerokl-runs of a fresh HOME), and
fails unless its metrics.jsonl has every step 1..N once (N: --steps, else the run's config.yaml), each with
`rollout_train/kl == 0.0` and `rollout_train/max_abs_logprob_diff == 0.0` over a non-empty set of tokens.
`extract` needs only the standard library, so it runs before any environment exists.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HEADING = "## Quick start"
EXACT_KEYS = ("rollout_train/kl", "rollout_train/max_abs_logprob_diff")


class CheckFailed(Exception):
    pass


def extract_block(readme: str, heading: str = HEADING) -> str:
    """The first ```bash block of the section whose heading starts with `heading`."""
    lines = readme.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        raise CheckFailed(f"no '{heading}' heading in the README")
    block = None
    for line in lines[start + 1:]:
        if block is None:
            if line.startswith("## "):
                break
            if line.strip() == "```bash":
                block = []
        elif line.strip() == "```":
            return "\n".join(block) + "\n"
        else:
            block.append(line)
    raise CheckFailed(f"no complete ```bash block in the README's '{heading}' section")


def find_run(path: Path) -> Path:
    if (path / "metrics.jsonl").is_file():
        return path
    runs = sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []
    if len(runs) != 1:
        raise CheckFailed(f"expected one run under {path}, found {len(runs)}: {[p.name for p in runs]}")
    if not (runs[0] / "metrics.jsonl").is_file():
        raise CheckFailed(f"{runs[0]} has no metrics.jsonl (did the job fail before its first step?)")
    return runs[0]


def expected_steps(run: Path) -> int:
    import yaml

    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise CheckFailed(f"{cfg_path} is missing; pass --steps")
    return int(yaml.safe_load(cfg_path.read_text())["train"]["steps"])


def check_run(run: Path, steps: int) -> list[dict]:
    """The run's records, in step order; raises CheckFailed naming every problem found."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    problems = []
    seen = [r.get("step") for r in records]
    if seen != list(range(1, steps + 1)):
        missing = sorted(set(range(1, steps + 1)) - set(seen))
        extra = sorted({s for s in seen if seen.count(s) > 1 or s not in range(1, steps + 1)}, key=str)
        problems.append(f"steps logged {len(seen)}, expected 1..{steps} once each (missing "
                        f"{missing[:10]}{'...' if len(missing) > 10 else ''}, repeated or unexpected {extra})")
    for rec in records:
        bad = {k: rec.get(k) for k in EXACT_KEYS if rec.get(k) != 0.0}
        if rec.get("rollout_train/tokens", 0) <= 0:  # a zero over no tokens proves nothing
            bad["rollout_train/tokens"] = rec.get("rollout_train/tokens")
        if bad:
            problems.append(f"step {rec.get('step')}: {bad}")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckFailed(f"{run / 'metrics.jsonl'}:\n  " + "\n  ".join(shown))
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="print the Quick start's bash block")
    ex.add_argument("readme", nargs="?", default=str(Path(__file__).resolve().parent.parent / "README.md"))
    ck = sub.add_parser("check", help="check a quick-start run's metrics.jsonl")
    ck.add_argument("path", help="a run directory, or a directory holding exactly one run")
    ck.add_argument("--steps", type=int, default=None, help="expected steps (default: the run's train.steps)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "extract":
            sys.stdout.write(extract_block(Path(args.readme).read_text()))
            return 0
        run = find_run(Path(args.path).expanduser())
        steps = args.steps if args.steps is not None else expected_steps(run)
        records = check_run(run, steps)
    except CheckFailed as e:
        print(f"quick start check FAILED: {e}", file=sys.stderr)
        return 1
    tokens = sum(r["rollout_train/tokens"] for r in records)
    print(f"quick start check passed: {run}\n  {steps} steps, rollout_train/kl == 0.0 and max |Δ logprob| == 0.0 "
          f"at every step ({tokens} tokens compared); reward {records[0]['reward/mean']:.3f} -> "
          f"{records[-1]['reward/mean']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
