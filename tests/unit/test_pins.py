"""Pins: written only for consistent checkpoints, journaled, read back as hostile input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ftsup.store import pins
from tests.helpers import default_files, make_fake_checkpoint

WHO = "alice@node1 42"


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    for step in (100, 200):
        make_fake_checkpoint(root, step, default_files(step))
    return root


def pin_file(root: Path, step: int) -> Path:
    return root / pins.PINS_DIRNAME / pins.pin_name(step)


def test_a_pin_is_a_file_of_the_contract_schema_readable_by_anyone(store: Path) -> None:
    pins.pin(store, 100, who=WHO, reason="before the spike", now=1234.5)
    path = pin_file(store, 100)
    got = (path.name, json.loads(path.read_text()), oct(path.stat().st_mode & 0o777))
    assert got == (
        "step_0000000100.json",
        {"v": 1, "step": 100, "who": WHO, "reason": "before the spike", "pinned_unix": 1234.5},
        "0o644",
    )


def test_pinning_a_step_without_a_checkpoint_is_refused_naming_it(store: Path) -> None:
    with pytest.raises(pins.PinError, match="step 150 is not a committed checkpoint"):
        pins.pin(store, 150, who=WHO, reason="", now=1.0)
    assert not (store / pins.PINS_DIRNAME).exists() or list((store / pins.PINS_DIRNAME).iterdir()) == []


def test_pinning_an_inconsistent_checkpoint_is_refused_naming_it(store: Path) -> None:
    (store / "step-000000200" / "shard-00000.safetensors").write_bytes(b"short")
    with pytest.raises(pins.PinError, match=r"step 200 \(.*step-000000200\) is not a consistent checkpoint"):
        pins.pin(store, 200, who=WHO, reason="", now=1.0)
    assert not pin_file(store, 200).exists()


def test_pinning_a_pinned_step_again_is_refused_and_keeps_the_first_pin(store: Path) -> None:
    pins.pin(store, 100, who=WHO, reason="first", now=1.0)
    with pytest.raises(pins.PinError, match="step 100 is pinned already"):
        pins.pin(store, 100, who="bob@node2 7", reason="second", now=2.0)
    assert json.loads(pin_file(store, 100).read_text())["reason"] == "first"


def test_a_link_planted_as_the_pin_is_never_written_through(store: Path, tmp_path: Path) -> None:
    (store / pins.PINS_DIRNAME).mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    pin_file(store, 100).symlink_to(target)
    with pytest.raises(pins.PinError):
        pins.pin(store, 100, who=WHO, reason="", now=1.0)
    assert target.read_text() == "untouched"


def test_a_pins_directory_that_is_a_link_is_refused(store: Path, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (store / pins.PINS_DIRNAME).symlink_to(tmp_path / "other")
    with pytest.raises(pins.PinError, match="is not a directory of pins"):
        pins.pin(store, 100, who=WHO, reason="", now=1.0)
    assert list((tmp_path / "other").iterdir()) == []


def test_pin_and_unpin_are_journaled_with_who_and_why(store: Path) -> None:
    pins.pin(store, 100, who=WHO, reason="keep it", now=1.0)
    pins.unpin(store, 100, who="bob@node2 7", reason="done", now=2.0)
    got = [(r["action"], r["step"], r["who"], r["reason"], r["unix"]) for r in pins.read_journal(store)]
    assert got == [("pin", 100, WHO, "keep it", 1.0), ("unpin", 100, "bob@node2 7", "done", 2.0)]


def test_unpin_removes_the_pin_and_returns_it(store: Path) -> None:
    pins.pin(store, 100, who=WHO, reason="keep it", now=1.0)
    old = pins.unpin(store, 100, who=WHO, reason="", now=2.0)
    assert (old, pin_file(store, 100).exists()) == (pins.Pin(100, WHO, "keep it", 1.0), False)


def test_unpin_of_an_unpinned_step_is_refused_naming_it(store: Path) -> None:
    pins.pin(store, 200, who=WHO, reason="", now=1.0)
    with pytest.raises(pins.PinError, match="step 100 is not pinned"):
        pins.unpin(store, 100, who=WHO, reason="", now=2.0)


def test_unpin_leaves_a_file_that_is_not_a_pin_in_place(store: Path) -> None:
    (store / pins.PINS_DIRNAME).mkdir()
    pin_file(store, 100).write_text("not json")
    with pytest.raises(pins.PinError, match="not valid JSON.*left as it is"):
        pins.unpin(store, 100, who=WHO, reason="", now=2.0)
    assert pin_file(store, 100).read_text() == "not json"


def test_read_pins_of_a_store_without_pins_is_empty_and_readable(store: Path) -> None:
    assert pins.read_pins(store) == pins.PinSet()


BAD_PINS = {
    "not json": b"{",
    "a list": b"[]",
    "another version": b'{"v": 2, "step": 100, "who": "", "reason": "", "pinned_unix": 1}',
    "version true": b'{"v": true, "step": 100, "who": "", "reason": "", "pinned_unix": 1}',
    "another step": b'{"v": 1, "step": 200, "who": "", "reason": "", "pinned_unix": 1}',
    "a string step": b'{"v": 1, "step": "100", "who": "", "reason": "", "pinned_unix": 1}',
    "a field missing": b'{"v": 1, "step": 100, "who": "", "pinned_unix": 1}',
    "an unknown field": b'{"v": 1, "step": 100, "who": "", "reason": "", "pinned_unix": 1, "x": 1}',
    "who not a string": b'{"v": 1, "step": 100, "who": 5, "reason": "", "pinned_unix": 1}',
    "a long reason": b'{"v": 1, "step": 100, "who": "", "reason": "' + b"x" * 2000 + b'", "pinned_unix": 1}',
    "NaN time": b'{"v": 1, "step": 100, "who": "", "reason": "", "pinned_unix": NaN}',
    "deep": b"[" * 1000 + b"]" * 1000,
    "huge": b" " * (pins.MAX_PIN_BYTES + 1),
}


@pytest.mark.parametrize("content", BAD_PINS.values(), ids=BAD_PINS.keys())
def test_a_bad_pin_file_keeps_its_checkpoint_and_is_reported(store: Path, content: bytes) -> None:
    (store / pins.PINS_DIRNAME).mkdir()
    pin_file(store, 100).write_bytes(content)
    got = pins.read_pins(store)
    assert (got.pins, got.kept, got.readable, [p.name for p in got.problems]) == (
        (),
        frozenset({100}),
        True,
        ["step_0000000100.json"],
    )


def test_a_pin_file_that_is_a_fifo_is_reported_without_blocking(store: Path) -> None:
    (store / pins.PINS_DIRNAME).mkdir()
    os.mkfifo(pin_file(store, 100))
    got = pins.read_pins(store)
    assert (got.kept, [p.reason for p in got.problems]) == (
        frozenset({100}),
        ["is not a regular file; refusing to read it; its checkpoint is kept"],
    )


def test_a_pin_file_that_is_a_link_is_not_followed_and_keeps_its_checkpoint(store: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"v": 1, "step": 100, "who": "", "reason": "", "pinned_unix": 1}))
    (store / pins.PINS_DIRNAME).mkdir()
    pin_file(store, 100).symlink_to(good)
    got = pins.read_pins(store)
    assert (got.pins, got.kept, "symbolic link" in str(got.problems[0])) == ((), frozenset({100}), True)


def test_a_name_that_is_not_a_pin_name_keeps_nothing_and_is_reported(store: Path) -> None:
    (store / pins.PINS_DIRNAME).mkdir()
    (store / pins.PINS_DIRNAME / "step_100.json").write_text("{}")
    got = pins.read_pins(store)
    assert (got.kept, [p.name for p in got.problems]) == (frozenset(), ["step_100.json"])


def test_a_pins_directory_that_is_a_link_is_unreadable(store: Path, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (store / pins.PINS_DIRNAME).symlink_to(tmp_path / "other")
    got = pins.read_pins(store)
    assert (got.readable, got.kept, str(got.problems[0])) == (
        False,
        frozenset(),
        "pins: is a symbolic link; refusing to follow it",
    )


def test_a_pins_directory_with_too_many_entries_is_unreadable(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pins, "MAX_PINS", 3)
    (store / pins.PINS_DIRNAME).mkdir()
    for step in range(4):
        pin_file(store, step).write_text("{}")
    assert pins.read_pins(store).readable is False
