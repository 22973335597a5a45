"""How the code is laid out, as numbers: files over 300 lines, functions and classes over 100 lines,
imports that go up or sideways between the layers (kernels < trainer_patch < rollout_service <
recipes, bench; the last two are peers), rollout_service's module graph (modules, import arrows
between them, cycles, and floors: a module with no import inside the package is on floor 0, any
other one floor above the highest it imports) and the README's length.

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
LONG_FILE, LONG_UNIT = 300, 100


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


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def module_graph(root: Path, package: str = "rollout_service") -> dict:
    """{module: set of the package's modules it imports}; `from pkg import name` counts the module
    `pkg.name` when there is one, else `pkg`; package __init__ files with no code are left out."""
    paths = {_module_name(root, p): p for p in sorted((root / package).rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        if path.name == "__init__.py" and all(isinstance(n, ast.Expr) for n in tree.body):
            continue  # a docstring only
        found = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            found |= {t for t in targets if t in paths and t != name}
        graph[name] = found
    return {m: {t for t in deps if t in graph} for m, deps in graph.items()}


def floors(graph: dict) -> tuple[dict, list]:
    """(each module's floor, the modules on import cycles, whose floors are not defined)."""
    level, cyclic, visiting = {}, set(), set()

    def visit(m):
        if m in level:
            return level[m]
        if m in visiting:
            cyclic.add(m)
            return 0
        visiting.add(m)
        level[m] = 1 + max((visit(d) for d in graph[m]), default=-1)
        visiting.discard(m)
        return level[m]
    for m in sorted(graph):
        visit(m)
    return level, sorted(cyclic)


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
    graph = module_graph(root)
    level, cyclic = floors(graph)
    readme = root / "README.md"
    return {"files_over_300_lines": files, "units_over_100_lines": units, "upward_imports": upward,
            "sideways_imports": sideways,
            "rollout_service": {"modules": len(graph), "arrows": sum(len(d) for d in graph.values()),
                                "floors": 1 + max(level.values(), default=-1), "cycles": cyclic},
            "readme_lines": len(readme.read_text().splitlines()) if readme.exists() else 0}


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
        if not isinstance(rows, list):
            print(f"{key}: {rows}")
            continue
        print(f"{key}: {len(rows)}")
        for row in rows:
            print("  " + "  ".join(str(v) for v in row.values()))


if __name__ == "__main__":
    main()
