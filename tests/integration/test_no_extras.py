"""`pip install ftsup` without extras: a working supervisor and CLI, and the missing extra named where torch-side
code is asked for.

One fresh virtual environment per module, without torch: a wheel built from a copy of the package folders (no
build isolation, so no network and nothing written to the checkout, as tests/integration/test_wheel.py builds it)
installed with pip and the dependencies pyproject.toml declares, nothing else. Every command runs with a bare
environment (no PYTHONPATH, PATH without this checkout's venv), so only the fresh installation is found; a torch
job's command names this interpreter, which has torch, as a user names the Python of their training venv.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import default_files, make_fake_checkpoint
from tests.procs import BIN, REPO

pytestmark = pytest.mark.multiprocess

FOLDERS = ("ftsup", "supervisor", "trainer")
INSTALL_TIMEOUT_S = 300
EXTRA = "pip install 'ftsup[trainer]'"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `bin` folder of a fresh venv holding ftsup installed without extras."""
    src, out, root = (tmp_path_factory.mktemp(name) for name in ("src", "wheel", "venv"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    pip = [sys.executable, "-m", "pip"]
    steps = [
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(out)],
        [sys.executable, "-m", "venv", "--without-pip", str(root)],
        [*pip, "--python", str(root / "bin" / "python"), "install", "-q", "WHEEL"],
    ]
    for argv in steps:
        argv = [str(next(out.glob("ftsup-*.whl"))) if a == "WHEEL" else a for a in argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        assert done.returncode == 0, (argv, done.stdout[-3000:], done.stderr[-3000:])
    return root / "bin"


def bare(venv: Path, argv: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{venv}:/usr/bin:/bin", "HOME": str(cwd), "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_plain_install_brings_neither_torch_nor_numpy(venv: Path, tmp_path: Path) -> None:
    probe = "import importlib.util as u; print([m for m in ('torch', 'numpy') if u.find_spec(m)])"
    done = bare(venv, [str(venv / "python"), "-c", probe], tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def test_ftsup_help_runs(venv: Path, tmp_path: Path) -> None:
    done = bare(venv, [str(venv / "ftsup"), "--help"], tmp_path)
    assert (done.returncode, "run" in done.stdout, done.stderr) == (0, True, "")


def test_ftsup_ckpt_list_runs(venv: Path, tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 100, default_files())
    done = bare(venv, [str(venv / "ftsup"), "ckpt", "list", str(tmp_path / "ckpt"), "--json"], tmp_path)
    steps = [c["step"] for c in json.loads(done.stdout)["checkpoints"]] if done.returncode == 0 else done.stderr
    assert steps == [100]


def test_ftsup_run_supervises_a_torch_job_whose_interpreter_has_torch(venv: Path, tmp_path: Path) -> None:
    job = [sys.executable, str(BIN / "plain_ddp.py"), "--steps", "3", "--dir", str(tmp_path)]
    done = bare(venv, [str(venv / "ftsup"), "run", "--nproc-per-node", "2", "--", *job], tmp_path, timeout=180)
    logged = len((tmp_path / "loss.jsonl").read_text().splitlines()) if done.returncode == 0 else done.stderr[-3000:]
    assert logged == 3


def test_ftsup_ckpt_show_reads_a_dcp_directory_without_torch(venv: Path, tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(3, 2)}, checkpoint_id=str(tmp_path / "step-4"), no_dist=True)
    done = bare(venv, [str(venv / "ftsup"), "ckpt", "show", str(tmp_path), "--json"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = json.loads(done.stdout)
    assert (shown["step"], shown["tensors"][0]["shape"]) == (4, [3, 2]), shown


TORCH_SIDE: dict[str, Any] = {
    "from ftsup import TrainingState": ["{python}", "-c", "from ftsup import TrainingState"],
    "the reference trainer": ["{python}", "-m", "ftsup.trainer.examples.gpt", "--steps", "1"],
    "ftsup ckpt export-hf": ["{ftsup}", "ckpt", "export-hf", "{tmp}", "{tmp}/out"],
    "ftsup ckpt export-dcp": ["{ftsup}", "ckpt", "export-dcp", "{tmp}", "{tmp}/out"],
    "ftsup ckpt import-deepspeed": ["{ftsup}", "ckpt", "import-deepspeed", "{tmp}", "{tmp}/out"],
    "ftsup bench checkpoint": ["{ftsup}", "bench", "checkpoint", "--size-mb", "1", "--dir", "{tmp}/bench"],
}


@pytest.mark.parametrize("asked", sorted(TORCH_SIDE))
def test_torch_side_code_asked_for_names_the_missing_extra(asked: str, venv: Path, tmp_path: Path) -> None:
    fill = {"python": str(venv / "python"), "ftsup": str(venv / "ftsup"), "tmp": str(tmp_path)}
    done = bare(venv, [a.format(**fill) for a in TORCH_SIDE[asked]], tmp_path)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    assert (done.returncode != 0, EXTRA in last) == (True, True), (done.returncode, done.stderr[-3000:])


def test_a_durable_tier_on_object_storage_asked_for_names_the_durable_extra(venv: Path, tmp_path: Path) -> None:
    done = bare(venv, [str(venv / "ftsup"), "ckpt", "list", "s3://bucket/run"], tmp_path)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    assert (done.returncode, last.startswith("ftsup: error: "), "pip install 'ftsup[durable]'" in last) == (
        2,
        True,
        True,
    )


def test_a_job_with_a_durable_tier_on_object_storage_is_refused_before_it_starts_naming_the_extra(
    venv: Path, tmp_path: Path
) -> None:
    argv = [str(venv / "ftsup"), "config", "check", "--checkpoint-durable", "s3://bucket/run", "--", "true"]
    done = bare(venv, argv, tmp_path)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    named = ("checkpoint.durable (s3://bucket/run) needs boto3" in last, "pip install 'ftsup[durable]'" in last)
    assert (done.returncode, named) == (2, (True, True)), done.stderr[-2000:]
