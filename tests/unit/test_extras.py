"""`ftsup.extras`: a module that an extra of ftsup installs, when missing, is reported with the extra's install line
(tests/integration/test_no_extras.py checks the same in an environment without torch)."""

from __future__ import annotations

import sys

import pytest

from ftsup import extras


def test_a_missing_torch_becomes_an_error_naming_the_trainer_extra() -> None:
    error = extras.explained(ModuleNotFoundError("No module named 'torch'", name="torch._C"), "ftsup.TrainingState")
    assert (type(error), error.name, str(error)) == (
        extras.MissingExtraError,
        "torch",
        f"ftsup.TrainingState needs torch, which this Python ({sys.executable}) cannot import; install ftsup's "
        "trainer extra: pip install 'ftsup[trainer]'",
    )


def test_a_missing_module_no_extra_provides_is_left_as_it_is() -> None:
    error = ModuleNotFoundError("No module named 'leftpad'", name="leftpad")
    assert extras.explained(error, "ftsup.X") is error


def test_require_names_the_extra_of_a_module_that_cannot_be_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "PROVIDED_BY", {"ftsup_no_such_module": "trainer"})
    with pytest.raises(extras.MissingExtraError, match=r"pip install 'ftsup\[trainer\]'$"):
        extras.require("trainer", "python -m ftsup.trainer.examples")


def test_require_passes_when_every_module_of_the_extra_is_found() -> None:
    extras.require("trainer", "this test")  # torch and numpy are installed here: no MissingExtraError
