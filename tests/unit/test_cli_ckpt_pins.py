"""`ftsup ckpt pin|unpin|show` in-process, and the pins `ftsup ckpt list` shows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from ftsup.store import pins
from ftsup.supervisor.cli.commands import main
from tests.helpers import default_files, make_fake_checkpoint
from tests.unit.test_cli import run


@pytest.fixture(autouse=True)
def _unconfigured_logging() -> Iterator[None]:
    """A pin configures logging when nothing has (a command of its own does): start unconfigured, as a process of
    its own does, whatever an earlier test left; leave structlog unconfigured."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    for step in (100, 200):
        make_fake_checkpoint(root, step, default_files(step))
    return root


def test_pin_writes_the_pin_and_says_how_to_undo_it(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ckpt", "pin", str(store), "--step", "100", "--reason", "before the spike")
    pin = pins.read_pins(store).pins[0]
    assert (code, pin.step, pin.reason, out.strip()) == (
        0,
        100,
        "before the spike",
        f"pinned step 100 under {store}: retention keeps it until `ftsup ckpt unpin {store} --step 100`",
    )


def test_pin_is_logged_with_who_and_why(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with capture_logs() as logged:
        main(["ckpt", "pin", str(store), "--step", "100", "--reason", "why not"])
    got = [(e["event"], e["step"], e["who"], e["reason"]) for e in logged]
    assert got == [("checkpoint_pinned", 100, pins.operator(), "why not")]


def test_unpin_is_logged_with_who_and_why(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["ckpt", "pin", str(store), "--step", "100"])
    with capture_logs() as logged:
        main(["ckpt", "unpin", str(store), "--step", "100", "--reason", "done"])
    got = [(e["event"], e["step"], e["who"], e["reason"]) for e in logged]
    assert got == [("checkpoint_unpinned", 100, pins.operator(), "done")]


def test_pin_json_prints_the_pin(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ckpt", "pin", str(store), "--step", "200", "--json")
    got = json.loads(out)
    assert (code, got["v"], got["step"], got["who"], got["reason"]) == (0, 1, 200, pins.operator(), "")


def test_pinning_a_step_that_is_no_checkpoint_is_exit_2_naming_it(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "ckpt", "pin", str(store), "--step", "150")
    assert (code, err.strip()) == (
        2,
        f"ftsup: error: step 150 is not a committed checkpoint under {store}; nothing pinned",
    )


def test_pin_needs_a_step(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "ckpt", "pin", str(store))
    assert (code, "--step" in err) == (2, True)


def test_a_reason_over_the_limit_is_refused_before_anything_is_written(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = run(capsys, "ckpt", "pin", str(store), "--step", "100", "--reason", "x" * (pins.MAX_TEXT_CHARS + 1))
    assert (code, (store / pins.PINS_DIRNAME).exists()) == (2, False)


def test_unpin_says_who_had_pinned_it(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "ckpt", "pin", str(store), "--step", "100", "--reason", "keep")
    code, out, _ = run(capsys, "ckpt", "unpin", str(store), "--step", "100")
    assert (code, out.strip()) == (0, f"unpinned step 100 under {store} (pinned by {pins.operator()}: keep)")


def test_list_json_marks_pinned_checkpoints_and_carries_the_pin(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(capsys, "ckpt", "pin", str(store), "--step", "100", "--reason", "keep")
    _, out, _ = run(capsys, "ckpt", "list", str(store), "--json")
    rows = [(c["step"], c["pinned"], (c["pin"] or {}).get("reason")) for c in json.loads(out)["checkpoints"]]
    assert rows == [(100, True, "keep"), (200, False, None)]


def test_list_json_reports_a_bad_pin_and_its_checkpoint_as_pinned(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (store / pins.PINS_DIRNAME).mkdir()
    (store / pins.PINS_DIRNAME / pins.pin_name(200)).write_text("{")
    _, out, _ = run(capsys, "ckpt", "list", str(store), "--json")
    got = json.loads(out)
    assert ([c["pinned"] for c in got["checkpoints"]], len(got["pin_problems"])) == ([False, True], 1)


def test_list_human_shows_the_pin_column(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "ckpt", "pin", str(store), "--step", "200")
    _, out, _ = run(capsys, "ckpt", "list", str(store))
    assert [line.split()[6] for line in out.splitlines()[:3]] == ["PIN", "-", "pinned"]


def test_list_human_shows_a_bad_pin_and_a_pin_without_its_checkpoint(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(capsys, "ckpt", "pin", str(store), "--step", "100")
    (store / pins.PINS_DIRNAME / pins.pin_name(100)).rename(store / pins.PINS_DIRNAME / pins.pin_name(7))
    (store / pins.PINS_DIRNAME / pins.pin_name(200)).write_text("[]")
    _, out, _ = run(capsys, "ckpt", "list", str(store))
    assert out.splitlines()[-2:] == [
        f"bad pin: pins/{pins.pin_name(7)}: holds step 100, but its name says step 7; its checkpoint is kept",
        f"bad pin: pins/{pins.pin_name(200)}: not a JSON object; its checkpoint is kept",
    ]


# --------------------------------------------------------------------------- ckpt show


def test_show_json_gives_the_manifest_the_data_skips_and_the_pin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpts"
    make_fake_checkpoint(root, 100, default_files(1), metadata={"step": 100, "data_skips": [[480, 504]]})
    make_fake_checkpoint(root, 200, default_files(2))
    run(capsys, "ckpt", "pin", str(root), "--step", "100", "--reason", "before the spike")
    code, out, _ = run(capsys, "ckpt", "show", str(root), "--step", "100", "--json")
    got = json.loads(out)
    assert (code, got["step"], got["consistent"], got["data_skips"], got["pinned"], got["pin"]["reason"]) == (
        0,
        100,
        True,
        [[480, 504]],
        True,
        "before the spike",
    )


def test_show_without_a_step_shows_the_newest(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ckpt", "show", str(store), "--json")
    assert (code, json.loads(out)["step"], json.loads(out)["data_skips"]) == (0, 200, [])


def test_show_human_lists_the_skips_and_the_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpts"
    make_fake_checkpoint(root, 100, default_files(1), metadata={"step": 100, "data_skips": [[480, 504]]})
    code, out, _ = run(capsys, "ckpt", "show", str(root))
    lines = out.splitlines()
    assert (code, "data_skips: [[480, 504]]" in lines, "metadata.data_skips: [[480, 504]]" in lines) == (0, True, True)


def test_show_of_an_absent_step_is_exit_2_naming_it(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "ckpt", "show", str(store), "--step", "150")
    assert (code, "no committed checkpoint for step 150" in err) == (2, True)
