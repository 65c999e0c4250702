"""The auto-instrumentation's machinery, apart from torch: post-import hooks (`imports`), failure containment
(`contain`), the default collective timeout (`collectives.with_default_timeout`) and the rank's PYTHONPATH once it
trains (`startup.leave_path`)."""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ftsup.trainer.auto import imports
from ftsup.trainer.auto.collectives import with_default_timeout
from ftsup.trainer.auto.contain import Piece
from ftsup.trainer.auto.startup import leave_path


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for modules written by a test, each imported for the first time."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("probe_")]:
        del sys.modules[name]


@pytest.fixture
def finder(monkeypatch: pytest.MonkeyPatch) -> imports.PostImportFinder:
    f = imports.PostImportFinder()
    monkeypatch.setattr(sys, "meta_path", [f, *sys.meta_path])
    return f


def test_a_hook_runs_right_after_its_modules_code_and_sees_what_it_defined(modules, finder):
    (modules / "probe_a.py").write_text("VALUE = 41\n")
    seen: list[int] = []
    finder.watch("probe_a", lambda m: seen.append(m.VALUE + 1))
    assert seen == []  # watching imports nothing
    import probe_a  # noqa: F401

    assert seen == [42]


def test_a_hook_runs_once_and_never_for_another_module(modules, finder):
    (modules / "probe_b.py").write_text("")
    (modules / "probe_c.py").write_text("")
    seen: list[str] = []
    finder.watch("probe_b", lambda m: seen.append(m.__name__))
    import probe_b  # noqa: F401
    import probe_c  # noqa: F401

    del sys.modules["probe_b"]
    import probe_b  # noqa: F401, F811

    assert seen == ["probe_b"]


def test_a_module_imported_already_gets_its_hook_at_once(modules, finder):
    (modules / "probe_d.py").write_text("")
    import probe_d  # noqa: F401

    seen: list[str] = []
    finder.watch("probe_d", lambda m: seen.append(m.__name__))
    assert seen == ["probe_d"]


def test_a_hook_that_fails_warns_and_the_import_still_succeeds(modules, finder):
    (modules / "probe_e.py").write_text("VALUE = 1\n")

    def broken(module: ModuleType) -> None:
        raise RuntimeError("boom")

    finder.watch("probe_e", broken)
    with pytest.warns(RuntimeWarning, match="a hook on probe_e failed"):
        import probe_e

    assert probe_e.VALUE == 1


def test_a_piece_that_fails_is_off_for_good_after_one_warning():
    piece = Piece("a probe")
    calls: list[int] = []

    def fails() -> None:
        calls.append(1)
        raise ValueError("no")

    with pytest.warns(RuntimeWarning, match="a probe failed .ValueError: no. and is off") as caught:
        first, second = piece.run(fails), piece.run(fails)
    assert (first, second, len(calls), piece.on, len(caught)) == (None, None, 1, False, 1)


def test_a_failure_under_warnings_as_errors_is_printed_never_raised(capsys):
    piece = Piece("a probe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        piece.run(lambda: 1 / 0)
    assert "a probe failed (ZeroDivisionError" in capsys.readouterr().err


def recorder(backend: str | None = None, init_method: str | None = None, timeout: Any = None, world_size: int = -1):
    return {"backend": backend, "timeout": timeout, "world_size": world_size}


TEN = datetime.timedelta(seconds=10)


@pytest.mark.parametrize(
    ("args", "kwargs", "timeout"),
    [
        (("gloo",), {}, TEN),
        (("gloo", None, None), {}, TEN),
        ((), {"backend": "gloo", "timeout": None}, TEN),
        (("gloo", None, datetime.timedelta(seconds=3)), {}, datetime.timedelta(seconds=3)),
        ((), {"timeout": datetime.timedelta(seconds=3)}, datetime.timedelta(seconds=3)),
    ],
)
def test_a_call_without_a_timeout_gets_the_default_and_one_with_keeps_its_own(args, kwargs, timeout):
    assert with_default_timeout(recorder, TEN)(*args, **kwargs)["timeout"] == timeout


def test_a_call_the_function_refuses_reaches_it_as_it_came():
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        with_default_timeout(recorder, TEN)("gloo", colour="red")


def test_the_hook_directory_leaves_pythonpath_and_the_rest_stays(tmp_path: Path):
    hook, other = tmp_path / "site", tmp_path / "user"
    env = {"PYTHONPATH": os.pathsep.join([str(hook), str(other)])}
    leave_path(str(hook), env)
    alone = {"PYTHONPATH": str(hook)}
    leave_path(str(hook), alone)
    assert (env, alone) == ({"PYTHONPATH": str(other)}, {})
