"""The ranks' start-up hook (`ftsup/trainer/auto/site/sitecustomize.py`) in real interpreters: it runs the
`sitecustomize` it shadows, installs its hooks only in a rank, imports no torch into a process that never does, and
once torch is imported leaves the PYTHONPATH of the processes the rank starts; an interpreter that cannot import ftsup
runs the script as it is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftsup.supervisor.run.instrument import hook_dir
from tests.procs import REPO

REPORT = """
import json, os, sys
from ftsup.trainer.auto import imports
report = {
    "hooked": isinstance(sys.meta_path[0], imports.PostImportFinder),
    "user": getattr(sys.modules.get("sitecustomize"), "RAN", False),
    "torch": "torch" in sys.modules,
}
if "--torch" in sys.argv:
    import torch
    report["wrapped"] = hasattr(torch.nn.Module.train, "__wrapped__")
    report["pythonpath"] = os.environ.get("PYTHONPATH", "")
print(json.dumps(report))
"""


def run_python(tmp_path: Path, *args: str, rank: bool = True) -> dict[str, object]:
    user = tmp_path / "user"
    user.mkdir(exist_ok=True)
    (user / "sitecustomize.py").write_text("RAN = True\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir()), str(user), str(REPO)])
    if rank:
        env["LOCAL_RANK"] = "0"
    done = subprocess.run(
        [sys.executable, "-c", REPORT, *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_in_a_rank_the_hooks_are_installed_and_the_shadowed_sitecustomize_still_runs(tmp_path):
    assert run_python(tmp_path) == {"hooked": True, "user": True, "torch": False}


def test_a_process_that_is_not_a_rank_gets_no_hooks(tmp_path):
    assert run_python(tmp_path, rank=False) == {"hooked": False, "user": True, "torch": False}


def test_once_torch_is_imported_it_is_instrumented_and_the_hook_leaves_pythonpath(tmp_path):
    got = run_python(tmp_path, "--torch")
    assert (got["wrapped"], str(hook_dir()) in str(got["pythonpath"]).split(os.pathsep)) == (True, False)


def test_an_interpreter_without_ftsup_runs_the_script_as_it_is_with_one_warning(tmp_path):
    bare = shutil.which("python3", path=os.defpath)  # the system's, outside this virtual environment
    env = {"PATH": os.defpath, "LOCAL_RANK": "0"}
    probe = [bare, "-c", "import ftsup"] if bare else None
    if probe is None or subprocess.run(probe, capture_output=True, timeout=60, env=env, cwd=tmp_path).returncode == 0:
        pytest.skip("no Python on this host without ftsup installed")
    env["PYTHONPATH"] = str(hook_dir())
    done = subprocess.run(
        [bare, "-c", "print('trained')"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    warned = [line for line in done.stderr.splitlines() if "auto-instrumentation is off" in line]
    assert (done.returncode, done.stdout, len(warned)) == (0, "trained\n", 1), done.stderr
