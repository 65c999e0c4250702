"""Events are defined once: every event the supervisor logs is listed in supervisor.logs.EVENTS."""

from __future__ import annotations

import re
from pathlib import Path

from supervisor.logs import EVENTS

SUPERVISOR = Path(__file__).resolve().parents[2] / "supervisor"


def logged_events() -> set[str]:
    found = set()
    for path in SUPERVISOR.rglob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r"\blog\.(?:debug|info|warning|error)\(\s*\"([a-z_]+)\"", text))
        found |= set(re.findall(r"\blog\(\s*\"([a-z_]+)\"", text))  # policy.log(...) actions
        found |= set(re.findall(r"\b_emit\(\s*\"[a-z]+\",\s*\"([a-z_]+)\"", text))  # the daemon's log-and-count
    return found


def test_every_logged_event_is_listed():
    assert logged_events() - EVENTS == set()


def test_event_names_are_snake_case_past_tense():
    assert [e for e in EVENTS if not re.fullmatch(r"[a-z]+(_[a-z]+)*", e)] == []
    assert [e for e in EVENTS if not re.search(r"(ed|lost|chosen|found|out|blind)$", e)] == []


def test_the_scan_sees_the_daemons_events():
    # The daemon logs through `_emit` (log and count a metric); a scan that missed those calls
    # would pass the test above vacuously.
    assert {"supervisor_started", "checkpoint_quarantined", "orphans_found", "eviction_noticed"} <= logged_events()


def test_logging_after_the_daemon_closed_its_log_file_still_works(tmp_path, capsys):
    import structlog

    from supervisor import logs

    old = structlog.get_config()
    try:
        handle = logs.configure("info", "json", tmp_path / "supervisor.jsonl")
        assert handle is not None
        structlog.get_logger("t").info("supervisor_started")
        handle.close()  # what Daemon.run does when it returns
        structlog.get_logger("t").info("checkpoint_committed")  # e.g. a checkpoint engine in the same process
    finally:
        structlog.configure(**old)
    lines = (tmp_path / "supervisor.jsonl").read_text().splitlines()
    err = capsys.readouterr().err
    assert "supervisor_started" in err and "checkpoint_committed" in err
    assert len(lines) == 1 and "supervisor_started" in lines[0]
