"""The plain PyTorch example is its baseline plus the Session's lines, and the README shows exactly
that diff. "Changed lines" are the diff's added plus removed lines (a modified line counts twice).
After a change to either script, paste `python -m tests.unit.test_plain_example_diff` into the
README's ```diff block.
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASELINE, ADOPTED = "trainer/examples/plain_baseline.py", "trainer/examples/plain.py"
MAX_CHANGED_LINES = 13


def diff_lines() -> list[str]:
    a, b = ((REPO / p).read_text().splitlines() for p in (BASELINE, ADOPTED))
    return list(difflib.unified_diff(a, b, BASELINE, ADOPTED, n=1, lineterm=""))


def test_the_plain_example_adopts_the_session_in_at_most_13_changed_lines():
    changed = [line for line in diff_lines()[2:] if line[:1] in "+-"]
    assert 0 < len(changed) <= MAX_CHANGED_LINES, "\n".join(changed)


def test_the_baseline_imports_nothing_of_ftsup():
    tree = ast.parse((REPO / BASELINE).read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [m for m in modules if m.split(".")[0] == "ftsup"] == []


def test_the_readme_shows_the_diff_of_the_two_examples_as_it_is():
    blocks = re.findall(r"^```diff\n(.*?)^```$", (REPO / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    shown = [b for b in blocks if f"+++ {ADOPTED}" in b]
    assert shown == ["\n".join(diff_lines()) + "\n"]


if __name__ == "__main__":
    print("\n".join(diff_lines()))
