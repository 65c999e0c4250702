"""The product imports no tooling: commands that do not benchmark or inject faults, and the daemon,
load no module of the benchmarks or of fault injection (the demo included), each checked in a new
interpreter, as tests/unit/test_torch_free.py checks torch.

The tooling is `ftsup.tools` (benchmarks, fault injection, the demo); `ftsup.supervisor.cli` imports a module
of it only for the command that runs it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import default_files, make_fake_checkpoint

REPO = Path(__file__).resolve().parents[2]
TOOLING = ("ftsup.tools",)


def tooling_loaded_after(code: str) -> list[str]:
    """The tooling modules in sys.modules after running `code` in a new interpreter from the repo root."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(done.stdout.splitlines()[-1])
    return [m for m in loaded if any(m == t or m.startswith(f"{t}.") for t in TOOLING)]


@pytest.fixture()
def job(tmp_path: Path) -> Path:
    """A config that `ftsup run` would accept, whose checkpoint directory holds one good checkpoint."""
    make_fake_checkpoint(tmp_path / "ckpt", 100, default_files())
    cfg = {
        "job": {"command": [sys.executable, "-c", "pass"], "workdir": str(tmp_path), "state_dir": str(tmp_path / "s")},
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_every_tooling_package_exists_so_that_not_finding_it_loaded_means_something() -> None:
    assert [t for t in TOOLING if importlib.util.find_spec(t) is None] == []


@pytest.mark.parametrize(
    "argv",
    [
        ["ckpt", "list", "{ckpt}"],
        ["ckpt", "list", "{ckpt}", "--json", "--deep"],
        ["ckpt", "verify", "{ckpt}", "--deep"],
        ["status", "--config", "{job}"],
        ["config", "check", "{job}"],
        ["run", "--help"],
        ["ckpt", "--help"],
        ["--help"],
    ],
    ids=" ".join,
)
def test_a_command_that_does_not_benchmark_or_inject_faults_imports_no_tooling(argv: list[str], job: Path) -> None:
    args = [a.format(ckpt=job.parent / "ckpt", job=job) for a in argv]
    assert tooling_loaded_after(f"from ftsup.supervisor.cli import main\nassert main({args!r}) == 0") == []


def test_the_daemon_imports_no_tooling() -> None:
    assert tooling_loaded_after("import ftsup.supervisor.run.daemon") == []
