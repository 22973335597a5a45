"""The README's Python blocks run as written (each in a fresh interpreter, as a reader would paste it)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2  # the engine snippet and the training-loop one


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    code = BLOCKS[index]
    # a fresh process: no Ray, models or state from other tests; its own working directory
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=_env(tmp_path))
    assert proc.returncode == 0, f"README python block {index} failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"


def _env(tmp_path):
    import os
    repo = str(README.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": repo if not path else f"{repo}{os.pathsep}{path}",
            "RAY_ADDRESS": "local"}  # never join a cluster another process started on this machine
