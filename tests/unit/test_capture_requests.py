"""An operator's capture request (`state.captures`): `ftsup incidents capture` writes it, the loop serves it once, and
a file that is not a request, or one older than the supervisor, is said ignored and never acted on."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ftsup.supervisor.policy.events import CaptureRequested
from ftsup.supervisor.state import captures
from ftsup.supervisor.state.captures import CaptureRequest, CaptureWatcher


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += captures.POLL_S
        return self.now


def watcher(tmp_path: Path, started: float = 1000.0) -> tuple[CaptureWatcher, list[tuple[str, dict]]]:
    said: list[tuple[str, dict]] = []
    w = CaptureWatcher(tmp_path, clock=Clock(), emit=lambda lvl, ev, **f: said.append((ev, f)), wall=lambda: started)
    return w, said


def test_a_request_is_served_once(tmp_path: Path):
    w, said = watcher(tmp_path)
    (tmp_path / captures.FILE_NAME).write_bytes(captures.encode(CaptureRequest("ab" * 8, "ops", "slow", 1001.0)))
    assert (w.poll(), w.poll(), said) == ([CaptureRequested("ab" * 8, "ops", "slow")], [], [])


def test_a_request_written_before_the_supervisor_started_is_not_served(tmp_path: Path):
    w, said = watcher(tmp_path)
    (tmp_path / captures.FILE_NAME).write_bytes(captures.encode(CaptureRequest("ab" * 8, "ops", "", 900.0)))
    assert (w.poll(), [ev for ev, _ in said]) == ([], ["capture_request_ignored"])


def test_a_link_and_a_file_that_is_not_a_request_are_said_ignored_once_each(tmp_path: Path):
    w, said = watcher(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_bytes(captures.encode(CaptureRequest("ab" * 8, "ops", "", 1001.0)))
    (tmp_path / captures.FILE_NAME).symlink_to(target)
    first = (w.poll(), w.poll())
    os.unlink(tmp_path / captures.FILE_NAME)
    (tmp_path / captures.FILE_NAME).write_text(json.dumps({"v": 1, "id": "../x", "requested_unix": 1001.0}))
    second = w.poll()
    reasons = [f["reason"] for _, f in said]
    assert (first, second, len(reasons), "symbolic link" in reasons[0], reasons[1]) == (
        ([], []),
        [],
        2,
        True,
        "'id' must be 16 hex digits",
    )
