"""scripts/structure_report.py's module graph on a small package written to disk: arrows (plain,
relative, `from pkg import module` and imports inside functions; __init__ files with no code left
out), floors, and cycles named."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "structure_report.py"


def _load():
    spec = importlib.util.spec_from_file_location("structure_report", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_module_graph_floors_and_cycles(tmp_path):
    sr = _load()
    _write(tmp_path, {
        "rollout_service/__init__.py": '"""only a docstring"""\n',
        "rollout_service/params.py": "import torch\n",
        "rollout_service/wing/__init__.py": "",
        "rollout_service/wing/a.py": "from rollout_service.params import X\n",
        "rollout_service/wing/b.py": "from . import a\n\ndef f():\n    from ..params import Y\n",
        "rollout_service/top.py": "import rollout_service.wing.b\n",
    })
    graph = sr.module_graph(tmp_path)
    assert graph == {
        "rollout_service.params": set(),
        "rollout_service.wing.a": {"rollout_service.params"},
        "rollout_service.wing.b": {"rollout_service.wing.a", "rollout_service.params"},
        "rollout_service.top": {"rollout_service.wing.b"},
    }
    level, cyclic = sr.floors(graph)
    assert level["rollout_service.top"] == 3 and level["rollout_service.params"] == 0 and cyclic == []
    _write(tmp_path, {"rollout_service/params.py": "from rollout_service.top import Z\n"})
    _, cyclic = sr.floors(sr.module_graph(tmp_path))
    assert "rollout_service.params" in cyclic
