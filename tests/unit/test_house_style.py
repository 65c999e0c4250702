"""STYLE.md's checkable rules, checked on every test run: ruff and mypy clean, modules short.

ruff and mypy are pinned in the `test` extra, so that a run on a fresh clone judges the code
with the same rules as the machine it was written on.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["ftsup", "supervisor", "trainer", "tests"]
# Where each import name's code lives (setup.py's package_dir): mypy finds modules by path, not through the
# editable install's import hook, so it is shown a tree of links with the installed layout.
IMPORT_LAYOUT = {"ftsup": "ftsup", "ftsup/supervisor": "supervisor", "ftsup/trainer": "trainer"}
# "One module per concept, small enough to read in one sitting (a few hundred lines)."
MAX_MODULE_LINES = 500


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _require(module: str) -> None:
    probe = _run(module, "--version", timeout=60)
    if probe.returncode != 0:
        pytest.fail(f"{module} is not installed: pip install -e '.[test]' installs the pinned version")


def test_ruff_finds_nothing_to_lint_or_reformat() -> None:
    _require("ruff")
    lint = _run("ruff", "check", "--no-cache", *PACKAGES)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run("ruff", "format", "--check", "--no-cache", *PACKAGES)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def installed_layout(root: Path) -> Path:
    """A tree of links under `root` in which `ftsup.supervisor` is `ftsup/supervisor/` (as installed)."""
    for name, folder in IMPORT_LAYOUT.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for entry in (REPO / folder).iterdir():
            if not (root / name / entry.name).exists() and entry.name != "__pycache__":
                (root / name / entry.name).symlink_to(entry)
    return root


def test_mypy_finds_no_type_errors(tmp_path: Path) -> None:
    _require("mypy")
    tree = installed_layout(tmp_path / "src")
    search = os.pathsep.join([str(tree), str(REPO)])  # `tests` is found in the repository itself
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache"), "-p", "ftsup", "-p", "tests"],
        cwd=REPO,
        env=dict(os.environ, MYPYPATH=search),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_module_reads_in_one_sitting() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for pkg in PACKAGES
        for p in sorted((REPO / pkg).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these by concept (at most {MAX_MODULE_LINES} lines each): {long}"


MAX_DOCSTRING_LINES = 5  # the module's purpose; the design prose lives in the docs (STYLE.md, Types and docs)


def module_docstring_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=False)
    return 0 if doc is None else len(doc.strip("\n").splitlines())


def test_every_module_docstring_says_what_it_is_for_in_at_most_five_lines() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for pkg in ("ftsup", "supervisor", "trainer")
        for p in sorted((REPO / pkg).rglob("*.py"))
        if (n := module_docstring_lines(p)) > MAX_DOCSTRING_LINES
    }
    assert long == {}


def test_no_line_is_kept_from_the_formatter() -> None:
    skipped = [
        f"{p.relative_to(REPO)}:{i}"
        for pkg in PACKAGES
        for p in sorted((REPO / pkg).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.rstrip().endswith("# fmt: " + "skip")
    ]
    assert skipped == []
