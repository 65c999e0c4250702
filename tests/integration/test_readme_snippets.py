"""Every ```python snippet of the README and of the pages under docs/ runs, or, marked as a fragment, parses and
imports only names that exist. Every fenced block whose info string is `python` is found, wherever it is.

- A snippet runs alone in a fresh interpreter, in an empty working directory, with `FTSUP_CHECKPOINT_DIR` pointing
  into it and no supervisor (no other `FTSUP_*` variable), and must exit 0 within 180 s.
- A snippet whose first line begins with `# fragment` (it continues a script the page does not show) must compile,
  each `from ftsup... import NAME` must name an attribute or submodule of its module, and each `import ftsup...`
  module must import.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import PYTHONPATH, REPO

FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
FRAGMENT = "# fragment"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def snippets() -> list[tuple[str, str]]:
    """(`PAGE:LINE`, code) for every ```python block of every page."""
    found: list[tuple[str, str]] = []
    for page in pages():
        text = page.read_text()
        where = page.relative_to(REPO).as_posix()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{where}:{line}", m.group(1)))
    return found


SNIPPETS = snippets()
IDS = [line for line, _ in SNIPPETS]


def is_fragment(code: str) -> bool:
    return code.lstrip().startswith(FRAGMENT)


def test_the_docs_have_python_snippets_that_run_alone():
    assert [line for line, code in SNIPPETS if not is_fragment(code)] != []


def test_the_snippets_are_found_in_the_readme_and_in_docs():
    found = {line.split(":")[0] for line, _ in SNIPPETS}
    assert ("README.md" in found, any(name.startswith("docs/") for name in found)) == (True, True)


@pytest.mark.parametrize(
    ("line", "code"),
    [s for s in SNIPPETS if not is_fragment(s[1])],
    ids=[i for i, s in zip(IDS, SNIPPETS, strict=True) if not is_fragment(s[1])],
)
def test_a_snippet_runs_alone(tmp_path: Path, line: str, code: str):
    (tmp_path / "snippet.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTSUP_")}
    env.update(PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", FTSUP_CHECKPOINT_DIR=str(tmp_path / "ckpt"))
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, f"{line}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize(
    ("line", "code"),
    [s for s in SNIPPETS if is_fragment(s[1])],
    ids=[i for i, s in zip(IDS, SNIPPETS, strict=True) if is_fragment(s[1])],
)
def test_a_fragment_parses_and_imports_only_names_that_exist(line: str, code: str):
    tree = ast.parse(code, filename=line)
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ftsup":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ftsup":
                    importlib.import_module(alias.name)
    assert missing == [], f"{line} imports names that do not exist"
