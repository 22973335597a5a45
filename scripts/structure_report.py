"""How the code is laid out, as numbers: files over 250 lines, functions and classes over 100 lines,
and imports that go up or sideways between the layers (kernels < trainer_patch < rollout_service <
recipes, bench; the last two are peers).

    python scripts/structure_report.py [--root DIR] [--json]

Counts the project packages only (tests are not a layer). An import inside a function counts too.
"""
from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

TIERS = (("kernels",), ("trainer_patch",), ("rollout_service",), ("recipes", "bench"))
LAYERS = tuple(p for tier in TIERS for p in tier)
TIER = {p: i for i, tier in enumerate(TIERS) for p in tier}
LONG_FILE, LONG_UNIT = 250, 100


def _package_of(module: str) -> str | None:
    top = module.split(".", 1)[0]
    return top if top in LAYERS else None


def _imports(tree: ast.AST, package: str) -> set[str]:
    """Top-level packages this module imports (relative imports stay inside its package)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(package if node.level else (node.module or ""))
    return {p for p in map(_package_of, found) if p}


def _long_units(tree: ast.AST, path: str) -> list[dict]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > LONG_UNIT:
                out.append({"unit": f"{path}:{node.lineno} {node.name}", "lines": lines})
    return out


def report(root: Path) -> dict:
    files, units, upward, sideways = [], [], [], []
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            text = path.read_text()
            tree = ast.parse(text)
            n = len(text.splitlines())
            if n > LONG_FILE:
                files.append({"file": rel, "lines": n})
            units += _long_units(tree, rel)
            for p in sorted(_imports(tree, package) - {package}):
                if TIER[p] > TIER[package]:
                    upward.append({"from": rel, "imports": p})
                elif TIER[p] == TIER[package]:
                    sideways.append({"from": rel, "imports": p})
    return {"files_over_250_lines": files, "units_over_100_lines": units, "upward_imports": upward,
            "sideways_imports": sideways}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rep = report(Path(args.root))
    if args.json:
        print(json.dumps(rep, indent=1))
        return
    for key, rows in rep.items():
        print(f"{key}: {len(rows)}")
        for row in rows:
            print("  " + "  ".join(str(v) for v in row.values()))


if __name__ == "__main__":
    main()
