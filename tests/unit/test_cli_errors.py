"""Every error of the `ftsup` command line is one line in the project's words: the path and what is wrong with it,
never an errno number or a Python repr. Real `ftsup` processes, each given a path that is the wrong kind of thing."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from ftsup.store.errors import os_error_line
from tests.helpers import default_files, make_fake_checkpoint
from tests.procs import PYTHONPATH, REPO


@dataclass(frozen=True)
class Case:
    kind: str
    argv: Callable[[Path], list[str]]  # the command line, given a prepared directory (`prepared`)
    says: str  # what the one line must say, `{tmp}` for the directory


def prepared(tmp: Path) -> Path:
    """A job config whose store holds a consistent checkpoint of step 10; returns the config."""
    make_fake_checkpoint(tmp / "ckpt", 10, default_files())
    (tmp / "state").mkdir()
    (tmp / "a-file").write_text("x")
    cfg = {
        "job": {"command": [sys.executable, "-c", "pass"], "workdir": str(tmp), "state_dir": str(tmp / "state")},
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "job.yaml"


def rollback_onto_a_directory(tmp: Path) -> list[str]:
    (tmp / "state" / "rollback.json").mkdir()
    return ["rollback", "--config", str(tmp / "job.yaml"), "--to-step", "10"]


def status_with_a_state_dir_under_a_file(tmp: Path) -> list[str]:
    cfg = yaml.safe_load((tmp / "job.yaml").read_text())
    cfg["job"]["state_dir"] = str(tmp / "a-file" / "state")
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    return ["status", "--config", str(tmp / "job.yaml")]


def rollback_with_a_state_dir_under_a_file(tmp: Path) -> list[str]:
    status_with_a_state_dir_under_a_file(tmp)
    return ["rollback", "--config", str(tmp / "job.yaml"), "--to-step", "10"]


def pin_with_a_journal_that_is_a_directory(tmp: Path) -> list[str]:
    (tmp / "ckpt" / "pins" / "journal.jsonl").mkdir(parents=True)
    return ["ckpt", "pin", str(tmp / "ckpt"), "--step", "10"]


def pin_with_a_journal_that_is_a_fifo(tmp: Path) -> list[str]:
    (tmp / "ckpt" / "pins").mkdir()
    os.mkfifo(tmp / "ckpt" / "pins" / "journal.jsonl")
    return ["ckpt", "pin", str(tmp / "ckpt"), "--step", "10"]


def config_under_a_file(tmp: Path) -> list[str]:
    return ["config", "check", str(tmp / "a-file" / "job.yaml")]


CASES = [
    Case(
        "rollback.json is a directory",
        rollback_onto_a_directory,
        "{tmp}/state/rollback.json: is a directory, not a file",
    ),
    Case(
        "status: state_dir under a file",
        status_with_a_state_dir_under_a_file,
        "{tmp}/a-file/state/journal.json: a part of its path is a file, not a directory",
    ),
    Case(
        "rollback: state_dir under a file",
        rollback_with_a_state_dir_under_a_file,
        "{tmp}/a-file/state cannot be created: a part of its path is a file, not a directory",
    ),
    Case("pins journal is a directory", pin_with_a_journal_that_is_a_directory, "cannot append (is a directory"),
    Case("pins journal is a FIFO", pin_with_a_journal_that_is_a_fifo, "cannot append (is a FIFO or a device"),
    Case(
        "config under a file",
        config_under_a_file,
        "{tmp}/a-file/job.yaml: cannot read it: a part of its path is a file, not a directory",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.kind for c in CASES])
def test_a_path_of_the_wrong_kind_is_one_line_in_words_and_exit_2(case: Case, tmp_path: Path) -> None:
    prepared(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "ftsup.supervisor.cli", *case.argv(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=PYTHONPATH),
    )
    lines = r.stderr.splitlines()
    raw = re.search(r"\[Errno|Errno \d|Error\(|Traceback", r.stderr)
    says = case.says.format(tmp=tmp_path)
    assert (r.returncode, len(lines), r.stderr.startswith("ftsup: error: "), says in r.stderr, raw) == (
        2,
        1,
        True,
        True,
        None,
    ), r.stderr


def test_a_rename_onto_a_directory_names_the_destination_not_the_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / ".target.tmp").write_text("x")
    try:
        os.replace(tmp_path / ".target.tmp", tmp_path / "target")
    except OSError as e:
        line = os_error_line(e)
    assert line == f"{tmp_path / 'target'}: is a directory, not a file"


def test_an_os_error_without_an_errno_keeps_its_own_words() -> None:
    assert os_error_line(OSError("/x/journal.json: is not a regular file; refused")) == (
        "/x/journal.json: is not a regular file; refused"
    )


def test_an_errno_without_words_of_ours_is_the_system_text_without_its_number() -> None:
    assert os_error_line(OSError(errno.ENOLINK, "Link has been severed", "/mnt/x")) == "/mnt/x: link has been severed"
