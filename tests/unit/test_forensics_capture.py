"""A capture (`run.forensics`) over real processes: with a stack tool that stops what it reads and never answers it
ends within its bound, a rank the tool left stopped is continued and one stopped before, or by someone else while
the tools let go of it, stays so; a record that cannot be written, or a capture that fails, is logged and the
capture returns: the stop after it is never held."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftsup import procs
from ftsup.supervisor.config.job import parse_config
from ftsup.supervisor.policy.events import CaptureEvidence
from ftsup.supervisor.run import forensics as forensics_module
from ftsup.supervisor.run.forensics import CONTINUED, Forensics, Target
from ftsup.supervisor.run.outages import Outages
from ftsup.supervisor.state import incidents
from tests.procs import wait_for

BOUND_S = 1.0


def settled(pid: int) -> str:
    """The process's state once it is asleep or stopped (a process just continued may run for a moment)."""

    def state() -> str | None:
        got = procs.run_state(pid)
        return got[0] if got is not None and got[0] in ("S", "T") else None

    return wait_for(state, 5, f"process {pid} to sleep or stop")


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        for p in ranks:
            settled(p.pid)
        yield ranks
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def capture_with(script: str, sleepers: list[subprocess.Popen[bytes]], tmp_path: Path) -> incidents.Incident:
    """A hang's capture of the sleepers, with `script` (shell, given the pid last) as the only stack tool."""
    tool = tmp_path / "pystack"
    tool.write_text("#!/bin/sh\neval pid=\\${$#}\n" + script)
    tool.chmod(0o755)
    raw = {"job": {"command": ["true"], "state_dir": str(tmp_path / "state")}, "forensics": {"tools": [str(tool)]}}
    cfg = parse_config(raw, base_dir=tmp_path, hostname="node")
    said: list[str] = []
    outages = Outages(lambda level, event, **f: said.append(event), lambda purpose: None, time.monotonic)
    forensics = Forensics(cfg, tmp_path / "state", clock=time.monotonic, emit=lambda *a, **k: None, outages=outages)
    targets = [Target(r, r, p.pid, (procs.run_state(p.pid) or ("?", None))[1]) for r, p in enumerate(sleepers)]
    try:
        incident = forensics.capture(CaptureEvidence(1, "hang", "heartbeat_timed_out", "test", BOUND_S), targets, None)
    finally:
        forensics.close()
    assert incident is not None, said
    return incident


def test_a_rank_a_stopped_tool_left_stopped_is_continued_and_a_rank_stopped_before_stays_so(
    sleepers: list[subprocess.Popen[bytes]], tmp_path: Path
):
    running, stopped = sleepers
    stopped.send_signal(signal.SIGSTOP)
    wait_for(lambda: (procs.run_state(stopped.pid) or ("?",))[0] == "T", 10, "the hung rank to stop")
    # The tool stops the rank it is asked for (as a tracer's attach does), then never answers.
    incident = capture_with('kill -STOP "$pid"\nsleep 60 &\nwait\n', sleepers, tmp_path)
    continued = {r.rank: CONTINUED in r.problems for r in incident.ranks}
    states = [settled(running.pid), settled(stopped.pid)]
    assert ((incident.duration_s or 0.0) <= BOUND_S, continued, states, incident.culprit) == (
        True,
        {0: True, 1: False},
        ["S", "T"],
        1,
    ), incident


def test_a_stop_that_comes_while_the_tools_let_go_on_their_own_is_someone_elses_and_stays(
    sleepers: list[subprocess.Popen[bytes]], tmp_path: Path
):
    # An operator's SIGSTOP (or a scheduler's suspend) comes during the capture; the tool exits on its own.
    incident = capture_with('kill -STOP "$pid"\nexit 0\n', sleepers, tmp_path)
    got = ([CONTINUED in r.problems for r in incident.ranks], [settled(p.pid) for p in sleepers])
    assert got == ([False, False], ["T", "T"]), incident


@pytest.mark.parametrize("bad", ["file", "link"])
def test_an_incidents_directory_that_cannot_be_used_is_a_storage_outage_and_the_capture_still_returns(
    bad: str, sleepers: list[subprocess.Popen[bytes]], tmp_path: Path
):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    if bad == "file":
        (state / "incidents").write_text("not a directory")
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        (state / "incidents").symlink_to(tmp_path / "elsewhere")
    raw = {"job": {"command": ["true"], "state_dir": str(state)}, "forensics": {"tools": []}}
    cfg = parse_config(raw, base_dir=tmp_path, hostname="node")
    said: list[str] = []
    outages = Outages(lambda level, event, **f: said.append(event), lambda purpose: None, time.monotonic)
    forensics = Forensics(cfg, state, clock=time.monotonic, emit=lambda *a, **k: None, outages=outages)
    targets = [Target(0, 0, sleepers[0].pid)]
    try:
        got = forensics.capture(CaptureEvidence(1, "hang", "heartbeat_timed_out", "test", BOUND_S), targets, None)
    finally:
        forensics.close()
    assert (got, said, list((tmp_path / "elsewhere").iterdir()) if bad == "link" else []) == (
        None,
        ["storage_failed"],
        [],
    )


def test_a_capture_that_fails_unforeseen_is_logged_and_returns_so_that_the_stop_goes_on(
    sleepers: list[subprocess.Popen[bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in naming the culprit")

    monkeypatch.setattr(forensics_module.stacks, "culprit", broken)
    raw = {"job": {"command": ["true"], "state_dir": str(tmp_path / "state")}, "forensics": {"tools": []}}
    cfg = parse_config(raw, base_dir=tmp_path, hostname="node")
    said: list[tuple[str, str]] = []
    outages = Outages(lambda level, event, **f: None, lambda purpose: None, time.monotonic)

    def emit(level: str, event: str, **fields: object) -> None:
        said.append((event, str(fields.get("reason", ""))))

    forensics = Forensics(cfg, tmp_path / "state", clock=time.monotonic, emit=emit, outages=outages)
    try:
        got = forensics.capture(
            CaptureEvidence(1, "hang", "heartbeat_timed_out", "test", BOUND_S), [Target(0, 0, sleepers[0].pid)], None
        )
    finally:
        forensics.close()
    assert (got, said) == (None, [("incident_failed", "RuntimeError: a bug in naming the culprit")])


def test_a_capture_that_stops_nothing_runs_aside_one_at_a_time_and_a_hang_capture_waits_for_it(
    sleepers: list[subprocess.Popen[bytes]], tmp_path: Path
):
    tool = tmp_path / "pystack"  # never answers: each capture lasts its whole bound
    tool.write_text("#!/bin/sh\nsleep 60 &\nwait\n")
    tool.chmod(0o755)
    raw = {"job": {"command": ["true"], "state_dir": str(tmp_path / "state")}, "forensics": {"tools": [str(tool)]}}
    cfg = parse_config(raw, base_dir=tmp_path, hostname="node")
    said: list[tuple[str, str]] = []
    outages = Outages(lambda level, event, **f: None, lambda purpose: None, time.monotonic)
    forensics = Forensics(
        cfg,
        tmp_path / "state",
        clock=time.monotonic,
        emit=lambda lv, ev, **f: said.append((ev, f["reason"])),
        outages=outages,
    )
    targets = [Target(0, 0, sleepers[0].pid)]
    try:
        t0 = time.monotonic()
        forensics.capture_aside(CaptureEvidence(1, "straggler", "straggler_detected", "slow", BOUND_S), targets, None)
        forensics.capture_aside(CaptureEvidence(1, "operator", "capture_requested", "ops", BOUND_S), targets, None)
        aside_s = time.monotonic() - t0  # the loop went on at once
        hang = forensics.capture(CaptureEvidence(1, "hang", "heartbeat_timed_out", "hung", BOUND_S), targets, None)
    finally:
        forensics.close()
    found, _ = forensics.store.read_all()
    assert (aside_s < BOUND_S / 2, sorted(i.trigger for i in found), hang is not None) == (
        True,
        ["hang", "straggler"],
        True,
    ), said
    failed = [reason for event, reason in said if event == "incident_failed"]
    assert failed == ["the operator capture is not taken: another capture is under way"]
