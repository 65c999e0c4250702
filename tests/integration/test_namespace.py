"""Every import name of ftsup is under `ftsup`: a user's own `trainer.py` or `supervisor.py` beside a training
script, and supervisord's `supervisor` package in the same environment, change nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.procs import BIN, kill_tree

SHADOWED = BIN / "shadowed"


def in_dir(argv: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run `argv` in `cwd` with no PYTHONPATH: what a user's shell does."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(cwd)},
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc.pid)
    return subprocess.CompletedProcess(argv, proc.returncode, out)


def users_project(tmp: Path) -> Path:
    project = tmp / "project"
    shutil.copytree(SHADOWED, project, ignore=shutil.ignore_patterns("__pycache__"))
    return project


def test_a_users_trainer_py_and_supervisor_py_beside_the_script_change_nothing(tmp_path: Path) -> None:
    project = users_project(tmp_path)
    first = in_dir([sys.executable, "train.py", str(tmp_path / "ckpt"), "3"], project)
    again = in_dir([sys.executable, "train.py", str(tmp_path / "ckpt"), "5"], project)
    assert (first.returncode, first.stdout.splitlines()[-1:], again.returncode, again.stdout.splitlines()[-1:]) == (
        0,
        ["resumed=None step=3"],
        0,
        ["resumed=3 step=5"],
    ), first.stdout + again.stdout


def test_ftsup_run_from_a_directory_holding_trainer_py_and_supervisor_py_finishes_the_job(tmp_path: Path) -> None:
    project = users_project(tmp_path)
    cfg = {
        "job": {"command": [sys.executable, "train.py", str(tmp_path / "ckpt"), "4"], "state_dir": str(tmp_path / "s")},
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
    }
    (project / "job.yaml").write_text(yaml.safe_dump(cfg))
    # `python -m` puts the current directory first on sys.path, where the user's two modules are.
    done = in_dir([sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", "job.yaml"], project, timeout=240)
    listed = in_dir(
        [sys.executable, "-m", "ftsup.supervisor.cli", "ckpt", "list", str(tmp_path / "ckpt"), "--json"], project
    )
    steps = [c["step"] for c in json.loads(listed.stdout)["checkpoints"]]
    assert (done.returncode, listed.returncode, steps) == (0, 0, [4]), done.stdout[-3000:]


def test_supervisord_installed_beside_ftsup_changes_nothing(tmp_path: Path) -> None:
    probe = (
        "import supervisor.supervisord, ftsup.supervisor.cli as cli, ftsup.trainer.state\n"
        "print(supervisor.__file__)\n"
        "raise SystemExit(cli.main(['ckpt', 'list', '--json', 'ckpt']))\n"
    )
    (tmp_path / "ckpt").mkdir()
    done = in_dir([sys.executable, "-c", probe], tmp_path)
    # supervisord is in the `test` extra, so this environment has both: its package owns the name `supervisor`.
    assert (done.returncode, "site-packages" in done.stdout.splitlines()[0]) == (0, True), done.stdout
