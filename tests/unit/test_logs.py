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
    return found


def test_every_logged_event_is_listed():
    assert logged_events() - EVENTS == set()


def test_event_names_are_snake_case_past_tense():
    assert [e for e in EVENTS if not re.fullmatch(r"[a-z]+(_[a-z]+)*", e)] == []
    assert [e for e in EVENTS if not re.search(r"(ed|lost|chosen|found|out|blind)$", e)] == []
