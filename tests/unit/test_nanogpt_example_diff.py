"""The nanoGPT-style script is its baseline plus the Session's lines, and docs/adopting.md shows exactly that diff.
"Changed lines" are the diff's added plus removed lines (a modified line counts twice). After a change to either
script, paste `python -m tests.unit.test_nanogpt_example_diff` into the page's ```diff block.
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASELINE, ADOPTED = "trainer/examples/nanogpt_baseline.py", "trainer/examples/nanogpt.py"
PAGE = "docs/adopting.md"
MAX_CHANGED_LINES = 10


def diff_lines() -> list[str]:
    a, b = ((REPO / p).read_text().splitlines() for p in (BASELINE, ADOPTED))
    return list(difflib.unified_diff(a, b, BASELINE, ADOPTED, n=1, lineterm=""))


def changed() -> list[str]:
    return [line for line in diff_lines()[2:] if line[:1] in "+-"]


def test_the_nanogpt_style_script_adopts_the_session_in_at_most_10_changed_lines():
    assert 0 < len(changed()) <= MAX_CHANGED_LINES, "\n".join(changed())


def test_the_nanogpt_style_baseline_imports_nothing_of_ftsup():
    tree = ast.parse((REPO / BASELINE).read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [m for m in modules if m.split(".")[0] == "ftsup"] == []


def test_adopting_leaves_the_scripts_own_batch_fetches_as_they_are():
    assert [line for line in changed() if "get_batch(" in line] == []


def test_the_adopting_page_shows_the_diff_of_the_two_scripts_as_it_is_and_counts_its_lines():
    text = (REPO / PAGE).read_text()
    blocks = re.findall(r"^```diff\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    shown = [b for b in blocks if f"+++ {ADOPTED}" in b]
    assert shown == ["\n".join(diff_lines()) + "\n"]
    assert f"in {len(changed())} changed lines" in text


if __name__ == "__main__":
    print("\n".join(diff_lines()))
