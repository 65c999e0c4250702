"""The suite's set-up: the checkout's bytecode compiled once where Python may not write it, DeepSpeed's builds kept
in this environment, the start-up hook of `tests/site` on the `PYTHONPATH` processes inherit, and `-m alone` (the
README's second pytest command) importing only the files that hold a test marked `alone`."""

from __future__ import annotations

import compileall
import os
import sys
from pathlib import Path

import pytest

from tests.procs import REPO, SITE


def pytest_configure(config: pytest.Config) -> None:
    # DeepSpeed's ranks build a C++ extension on first use, by default in a cache every checkout of this user shares:
    # two checkouts' builds (their flags differ) rebuild each other's, and one killed leaves a lock the other's wait
    # on. This environment's builds stay in it.
    if os.access(sys.prefix, os.W_OK):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    # Tools that build their children's environment from this one (the benchmarks, chaos, the demo) pass it on.
    if str(SITE) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(SITE)]))
    # With PYTHONDONTWRITEBYTECODE set, every rank, agent and supervisor the suite starts would compile the
    # checkout's modules from source again; compiled once here, they are read like the installed packages'.
    if sys.dont_write_bytecode and not hasattr(config, "workerinput"):
        for folder in ("ftsup", "supervisor", "trainer", "tests"):
            compileall.compile_dir(REPO / folder, quiet=2, workers=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `--dist loadfile` hands the modules out in this order: the long ones first, so that no worker is still in one
    # while the other has run out of modules (docs/testing.md, Where the time goes).
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("markexpr") != "alone" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    try:
        return "mark.alone" not in collection_path.read_text(errors="replace") or None
    except OSError:
        return None
