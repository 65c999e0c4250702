"""The suite's collection: `-m alone` (the README's second pytest command) imports only the files that hold a test
marked `alone`, instead of every test module for the ten tests it runs."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("markexpr") != "alone" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    try:
        return "mark.alone" not in collection_path.read_text(errors="replace") or None
    except OSError:
        return None
