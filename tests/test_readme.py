"""The Python blocks of the README and of the docs it sends users to run as a new user runs them: each saved
verbatim as a file and run with `python file.py`, in a fresh interpreter with a fresh HOME. Saved as a file
matters: vLLM's engine core starts its process by spawn, which re-imports the main module (a `python -c`
snippet has none)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()
# the pages users copy code from: the README and the docs its "Where it plugs in" list sends them to
USER_PAGES = [README, ROOT / "docs" / "integrations.md", ROOT / "docs" / "lora.md"]
BLOCKS = [(page.relative_to(ROOT).as_posix(), code) for page in USER_PAGES
          for code in re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)]
# set by a test session or a developer's shell, never by the README: a new user has none of these
SESSION_VARIABLE_PREFIXES = ("PYTHONPATH", "VLLM_", "RAY_", "ZEROKL_", "PYTEST_", "WANDB_", "HF_", "XDG_",
                             "TORCHINDUCTOR_", "TRITON_", "MASTER_ADDR", "MASTER_PORT")


def _starts_processes(code: str) -> bool:
    """A block that starts Ray or a vLLM engine takes tens of seconds on a CPU."""
    return "ray.init" in code or "from vllm import" in code


def _cases():
    return [pytest.param(i, marks=[pytest.mark.slow] if _starts_processes(code) else [], id=f"{page}-{i}")
            for i, (page, code) in enumerate(BLOCKS)]


def test_the_user_pages_have_python_blocks():
    pages = [page for page, _ in BLOCKS]
    assert pages.count("README.md") >= 2  # the engine snippet, the training-loop one
    assert "docs/integrations.md" in pages and "docs/lora.md" in pages  # vLLM's LLM; the LoRA round trip


@pytest.mark.parametrize("index", _cases())
def test_documented_python_block_runs_as_a_saved_script(index, tmp_path):
    page, code = BLOCKS[index]
    if "from vllm import" in code:
        pytest.importorskip("vllm")
    script = tmp_path / "readme_block.py"
    script.write_text(code)
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=new_user_env(home))
    assert proc.returncode == 0, f"{page}: python block {index} failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"


def new_user_env(home: Path) -> dict:
    """This process's environment as a new user's shell has it: a fresh HOME (no ~/.ray, no caches) and
    none of the variables a test session sets. The package is found as installed (pip install -e .)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SESSION_VARIABLE_PREFIXES)}
    # a machine with no Ray cluster running: ray.init() starts its own, never joins another's
    return {**env, "HOME": str(home), "RAY_ADDRESS": "local"}


def test_the_readme_says_what_ray_stop_stops():
    """`ray stop` ends every Ray cluster and process on the machine, not just the quick start's; a user
    on a shared machine must be told before running it."""
    sentences = [s for s in re.split(r"(?<=[.;])\s+", TEXT.replace("\n", " ")) if "`ray stop`" in s]
    assert sentences, "the README no longer mentions `ray stop`"
    for sentence in sentences:
        assert re.search(r"every (other )?Ray (cluster|process)[^.;]* on (the|this) machine", sentence), sentence


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_resolve():
    """Every relative link of the README and docs/ names a file that exists and, with `#anchor`, one of its
    headings: sections move between these pages, and a link left behind must fail here, not for a user."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
