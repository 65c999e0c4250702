"""The `ftsup run ... -- CMD` lines of the README and docs/ (their shell snippets of runs without a YAML file) are
command lines that `ftsup config check` accepts with the same arguments, so that each would start; checked in an empty
directory, with `python` found on PATH as this interpreter."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from ftsup.supervisor.cli.commands import main

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]


def zero_line_runs(pages: list[Path] = PAGES) -> list[str]:
    blocks = [block for page in pages for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)]
    return [line for block in blocks for line in block.splitlines() if line.startswith("ftsup run ") and " -- " in line]


def test_the_readme_shows_runs_without_a_yaml_file() -> None:
    assert len(zero_line_runs([README])) >= 2


@pytest.mark.parametrize("line", zero_line_runs())
def test_a_readme_run_line_is_accepted_by_config_check(
    line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}")
    args = shlex.split(line, comments=True)[2:]  # after `ftsup run`
    code = main(["config", "check", *args])
    assert (code, capsys.readouterr().err) == (0, "")
