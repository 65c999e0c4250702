"""The daemon's error boundaries, without torchrun: a storage outage is logged, counted and retried (never fatal),
a failed launch is a failed attempt, and a bug ends `ftsup run` with exit status 1, its traceback in the log, one
line on stderr and the same code in `supervisor_exited`."""

from __future__ import annotations

import json
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from structlog.testing import capture_logs

from ftsup.supervisor import statedir
from ftsup.supervisor.cli.commands import main
from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.run import resume
from ftsup.supervisor.run.daemon import Daemon
from ftsup.supervisor.run.outages import RETRY_INITIAL_S
from ftsup.supervisor.run.resume import ResumeChoice
from ftsup.supervisor.state.journal import JournalRecord
from tests.helpers import slow_choices, torn_newest
from tests.procs import wait_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_config(tmp: Path, **sections: dict) -> Path:
    cfg: dict = {
        "job": {"command": [sys.executable, "-c", "pass"], "workdir": str(tmp), "state_dir": str(tmp / "state")},
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }
    for name, keys in sections.items():
        cfg.setdefault(name, {}).update(keys)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def daemon(tmp: Path, clock: FakeClock, **sections: dict) -> Daemon:
    (tmp / "state").mkdir(mode=0o700, exist_ok=True)  # what `Daemon.run` makes sure of before anything else
    return Daemon(load_config(write_config(tmp, **sections), hostname="node-a"), clock=clock)


def replace_by_a_file(path: Path) -> Path:
    """Move the directory `path` aside and put a file in its place (what an outage looks like); return the aside."""
    aside = path.with_name(path.name + ".aside")
    path.rename(aside)
    path.write_text("not a directory")
    return aside


def put_back(path: Path, aside: Path) -> None:
    path.unlink()
    aside.rename(path)


def storage_errors(d: Daemon, purpose: str) -> float | None:
    return d.metrics.registry.get_sample_value("ftsup_storage_errors_total", {"purpose": purpose})


def events(logs: Sequence[MutableMapping[str, Any]]) -> list[str]:
    return [e["event"] for e in logs]


# --------------------------------------------------------------------------- the checkpoint store


def test_an_unreadable_store_delays_the_launch_instead_of_starting_from_scratch(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "ckpt").mkdir()
    d = daemon(tmp_path, clock)
    replace_by_a_file(tmp_path / "ckpt")
    with capture_logs() as logs:
        d.resume.prepare_or_retry(1)
    failed = [e for e in logs if e["event"] == "storage_failed"]
    assert (d.pending, len(failed), failed[0]["purpose"], failed[0]["path"], storage_errors(d, "checkpoint_dir")) == (
        [],
        1,
        "checkpoint_dir",
        str(tmp_path / "ckpt"),
        1.0,
    )


def test_the_delayed_launch_goes_ahead_once_the_store_is_back(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "ckpt").mkdir()
    d = daemon(tmp_path, clock)
    aside = replace_by_a_file(tmp_path / "ckpt")
    d.resume.prepare_or_retry(1)
    put_back(tmp_path / "ckpt", aside)
    clock.now += RETRY_INITIAL_S
    with capture_logs() as logs:
        d.outages.run_due()
    assert (d.pending, "storage_recovered" in events(logs)) == ([policy.LaunchReady(1, None, None)], True)


def test_a_resume_choice_that_came_too_late_still_logs_what_it_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torn = torn_newest(tmp_path / "ckpt")
    release = slow_choices(monkeypatch)
    monkeypatch.setattr(resume, "CHOICE_TIMEOUT_S", 0.2)
    d = daemon(tmp_path, FakeClock())
    with d.resume.running(), capture_logs() as logs:
        ready = d.resume.prepare(attempt=1)
        assert ready is not None and ready.resume_step is None  # left to the ranks' own load
        release.set()
        wait_for(lambda: (torn.parent / (torn.name + ".corrupt")).exists(), 10, "the late choice never quarantined")

        def told() -> bool:
            d.resume.refresh_metrics()  # the loop's tick
            return "checkpoint_quarantined" in events(logs)

        wait_for(told, 10, "the late quarantine was never logged")
    late = [e for e in logs if e["event"] == "checkpoint_quarantined"]
    assert [(e["attempt"], e["step"], e["late"]) for e in late] == [(1, 200, True)]


def test_a_store_read_for_the_metrics_that_fails_is_counted_and_not_raised(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "ckpt").mkdir()
    d = daemon(tmp_path, clock)
    replace_by_a_file(tmp_path / "ckpt")
    with capture_logs() as logs:
        d.resume.store.scan()  # what the scanner's thread does every few seconds
        d.resume.refresh_metrics()
    assert (events(logs), storage_errors(d, "checkpoint_dir")) == (["storage_failed"], 1.0)


def test_a_long_outage_logs_one_line_per_minute_but_counts_every_failure(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "ckpt").mkdir()
    d = daemon(tmp_path, clock)
    replace_by_a_file(tmp_path / "ckpt")
    with capture_logs() as logs:
        for _ in range(31):  # one read every 2 s for a minute
            d.resume.store.scan()
            d.resume.refresh_metrics()
            clock.now += 2.0
    assert (events(logs), storage_errors(d, "checkpoint_dir")) == (["storage_failed", "storage_failed"], 31.0)


# --------------------------------------------------------------------------- the journal


def test_a_journal_write_that_fails_is_retried_until_it_succeeds(tmp_path: Path) -> None:
    clock = FakeClock()
    d = daemon(tmp_path, clock)
    aside = replace_by_a_file(tmp_path / "state")
    with capture_logs() as logs:
        d.journal.write("running")
    put_back(tmp_path / "state", aside)
    clock.now += RETRY_INITIAL_S
    d.outages.run_due()
    written = json.loads((tmp_path / "state" / "journal.json").read_text())
    assert (events(logs), storage_errors(d, "journal"), written["status"]) == (["storage_failed"], 1.0, "running")


def test_a_journal_retry_waits_longer_after_each_failure(tmp_path: Path) -> None:
    clock = FakeClock()
    d = daemon(tmp_path, clock)
    replace_by_a_file(tmp_path / "state")
    d.journal.write("running")
    waits = []
    for _ in range(3):
        due = d.outages.due("journal")
        assert due is not None
        waits.append(due - clock.now)
        clock.now = due
        d.outages.run_due()
    assert waits == [RETRY_INITIAL_S, 2 * RETRY_INITIAL_S, 4 * RETRY_INITIAL_S]


def test_a_supervisor_that_launched_nothing_journals_the_attempt_it_adopted(tmp_path: Path) -> None:
    d = daemon(tmp_path, FakeClock())
    left = JournalRecord(run_id="another-job", node_id="node-a", supervisor_pid=1, attempt=5, status="failed")
    d.journal.file.write(left)  # another job's: adopted for its number, nothing of it is stopped
    adopted = d.journal.adopt()
    d.journal.write("stopped")  # e.g. an operator's stop while the first launch waited for the store
    written = d.journal.file.read()
    assert (adopted, written.attempt if written else None) == (5, 5)  # the next supervisor's numbering goes on


# --------------------------------------------------------------------------- launches


def test_a_launch_that_cannot_start_is_a_failed_attempt(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "logs").write_text("a file where the attempt's log directory should be")
    d = daemon(tmp_path, clock, logging={"dir": str(tmp_path / "logs")})
    with capture_logs() as logs, d.workers.running(tmp_path):
        d.workers.launch_or_fail(policy.Launch(1, 1, None))
    failed = [e for e in logs if e["event"] == "launch_failed"]
    assert (len(failed), str(tmp_path / "logs") in failed[0]["reason"], d.pending, d.workers.attempt) == (
        1,
        True,
        [policy.WorkersExited(1, 127)],
        None,
    )


# --------------------------------------------------------------------------- bugs


@pytest.fixture()
def restore_structlog():
    """Daemon.run configures structlog for the process; put the test session's configuration back."""
    old = structlog.get_config()
    yield
    structlog.configure(**old)


def raise_a_bug(self: ResumeChoice) -> int:
    raise RuntimeError("a bug in the loop")


def test_a_bug_in_the_loop_exits_1_with_one_line_and_the_traceback_in_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_structlog: None
) -> None:
    monkeypatch.setattr(ResumeChoice, "nproc_max", raise_a_bug)
    code = main(["run", "--config", str(write_config(tmp_path))])
    last_line = capsys.readouterr().err.splitlines()[-1]
    logged = [json.loads(line) for line in (tmp_path / "state" / "logs" / "supervisor.jsonl").read_text().splitlines()]
    crashed = next(e for e in logged if e["event"] == "supervisor_crashed")
    assert (code, last_line.startswith("ftsup: error: internal error: RuntimeError: a bug in the loop")) == (1, True)
    assert ("raise_a_bug" in crashed["traceback"], logged[-1]["event"], logged[-1]["code"]) == (
        True,
        "supervisor_exited",
        1,
    )


def refuse_the_runtime_dir(cls: type, state_dir: Path, environ: object) -> Path:
    raise PermissionError(13, "Permission denied", str(state_dir / "run"))


def test_an_io_error_while_starting_exits_1_with_one_line_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_structlog: None
) -> None:
    monkeypatch.setattr(statedir.RuntimeDir, "make", classmethod(refuse_the_runtime_dir))
    code = main(["run", "--config", str(write_config(tmp_path))])
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert (code, last_line) == (1, f"ftsup: error: cannot start: {tmp_path / 'state' / 'run'}: permission denied")


def test_a_scan_that_works_again_logs_the_recovery(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "ckpt").mkdir()
    d = daemon(tmp_path, clock)
    aside = replace_by_a_file(tmp_path / "ckpt")
    d.resume.store.scan()
    d.resume.refresh_metrics()
    put_back(tmp_path / "ckpt", aside)
    with capture_logs() as logs:
        d.resume.store.scan()
        d.resume.refresh_metrics()
    assert (events(logs), storage_errors(d, "checkpoint_dir")) == (["storage_recovered"], 1.0)
