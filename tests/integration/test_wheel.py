"""A plain (non-editable) install ships everything: the wheel that `pip wheel` builds from the
repository holds every package folder (each directory with an `__init__.py` under supervisor/
and trainer/, and ftsup/) with all its modules, and the C extension's source; installed from it,
every `ftsup bench` and `ftsup demo` parse their flags and the tooling finds the installed `ftsup`.

One module-scoped build serves every claim. It builds from a copy of the package folders, so the
checkout gets no build/ or egg-info, and without build isolation (the environment's setuptools,
which torch requires), so that it needs no network.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"ftsup": "ftsup", "supervisor": "ftsup/supervisor", "trainer": "ftsup/trainer"}  # folder -> in the wheel
BUILD_TIMEOUT_S = 300


def _setuptools_builds_wheels() -> bool:
    try:
        major, minor = (int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (70, 1)  # from 70.1 setuptools has bdist_wheel itself, without `wheel`


def repository_files(suffixes: tuple[str, ...]) -> set[str]:
    """Where each file with one of `suffixes` in a package folder of the repository lands in the wheel."""
    found = set()
    for folder, target in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            for path in init.parent.iterdir():
                if path.is_file() and path.suffix in suffixes:
                    found.add(f"{target}/{path.relative_to(REPO / folder).as_posix()}")
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _setuptools_builds_wheels():
        pytest.skip("building a wheel without network needs setuptools >= 70.1 in this environment")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = out.glob("ftsup-*.whl")
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
    return {"path": path, "names": names}


def test_the_wheel_holds_every_package_folder(wheel: dict[str, Any]) -> None:
    packages = {name for name in repository_files((".py",)) if name.endswith("/__init__.py")}
    some = {
        "ftsup/__init__.py",
        "ftsup/tools/bench/__init__.py",
        "ftsup/supervisor/run/__init__.py",
        "ftsup/trainer/checkpoint/__init__.py",
    }
    assert (sorted(packages - wheel["names"]), some <= packages) == ([], True)


def test_the_wheel_holds_every_module_of_every_package(wheel: dict[str, Any]) -> None:
    assert sorted(repository_files((".py",)) - wheel["names"]) == []


def test_the_wheel_holds_the_c_extensions_source(wheel: dict[str, Any]) -> None:
    sources = repository_files((".c",))
    assert (sorted(sources - wheel["names"]), len(sources) >= 1) == ([], True)


def test_installed_from_the_wheel_the_tooling_commands_parse_and_find_the_installed_ftsup(
    wheel: dict[str, Any], tmp_path: Path
) -> None:
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target)]
    subprocess.run([*install, str(wheel["path"])], check=True, capture_output=True, timeout=120)
    probe = (
        "import sys\n"
        "from ftsup.supervisor.cli import main\n"
        "from ftsup.tools.faults.refjob import CODE_ROOT\n"
        "import ftsup.supervisor.cli as cli\n"
        "print(cli.__file__, CODE_ROOT)\n"
        "for argv in (['bench', 'recovery', '--help'], ['bench', 'eviction', '--help'],\n"
        "             ['bench', 'checkpoint', '--help'], ['demo', '--help']):\n"
        "    assert main(argv) == 0, argv\n"
    )
    # PYTHONPATH comes before site-packages, where the editable install of this checkout is found.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target)}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cli_file, code_root = done.stdout.splitlines()[0].split()
    assert (Path(cli_file).is_relative_to(target), Path(code_root)) == (True, target.resolve())
