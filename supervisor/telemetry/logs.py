"""Structured logs: one JSON object per line (`event`, `level`, `timestamp`, and the fixed keys
`attempt`, `world_size`, `rank`, `step`, `reason`, `duration_s` where they apply).

`configure()` is called once by `ftsup run`; everything else just uses `structlog.get_logger()`. The log file gets
JSON; stderr gets JSON, or on a terminal (and always with `logging.format: console`) the short lines of
`console`, one per change of state a person watches for.
The event names are defined here, once, in `EVENTS` (snake_case, past tense): the policy's log
actions and the daemon's own events use no others (tests/unit/test_logs.py captures what they
emit), and `ftsup_events_total` counts each under its name.
"""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

from ftsup.supervisor import statedir
from ftsup.supervisor.telemetry import console

EVENTS = frozenset(
    {
        "checkpoint_pinned", "checkpoint_unpinned",  # by `ftsup ckpt pin|unpin`, not the daemon
        "durable_choice_failed",  # the durable tier had no part in a resume choice (it failed or did not answer)
        "supervisor_started", "journal_adopted", "leftovers_stopped", "health_probed",
        "health_probe_failed", "checkpoint_chosen", "checkpoint_quarantined", "checkpoint_skipped", "world_size_chosen",
        "workers_launched", "workers_restarted", "heartbeats_dropped", "journal_ignored",
        "heartbeat_timed_out", "progress_timed_out", "startup_timed_out", "worker_exited", "workers_stopped",
        "orphans_found", "restart_scheduled", "crash_loop_detected", "restart_budget_exhausted", "job_succeeded",
        "job_failed", "job_stopped", "stop_requested", "eviction_noticed", "save_requested", "checkpoint_committed",
        "save_skipped", "requeue_requested", "requeue_failed", "watcher_went_blind", "watcher_recovered",
        "supervisor_exited", "metrics_scrape_failed", "storage_failed", "storage_recovered", "launch_failed",
        "supervisor_crashed", "first_step_reached", "checkpoint_found",
        "anomaly_detected", "anomaly_escalated", "rollback_started", "rollback_requested", "rollback_refused",
        "rollback_request_ignored", "data_skipped", "checkpoint_abandoned", "straggler_detected", "straggler_recovered",
        "throughput_drift_detected", "throughput_drift_recovered", "spare_agent_parked", "spare_agent_used",
        "spare_agent_failed", "durable_upload_started", "durable_committed", "durable_upload_failed",
        "durable_dropped", "durable_deleted", "durable_retention_failed", "durable_deadline_missed",
    }
)  # fmt: skip

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _Sink:
    """Where each event goes: its JSON line to the node's log file, and to stderr either the same line or its
    console reading (`console.line`; nothing for an event with none). A file closed since (the daemon closes its
    log file when it returns; code that logs after that in the same process must not fail on it) is skipped."""

    def __init__(self, err: TextIO, file: TextIO | None, *, human: bool) -> None:
        self.err, self.file, self.human = err, file, human

    def msg(self, line: str, human: str | None) -> None:
        shown = human if self.human else line
        if shown is not None and not self.err.closed:  # stderr first: the line is seen even if the file fails
            self.err.write(shown + "\n")
            self.err.flush()
        if self.file is not None and not self.file.closed:
            self.file.write(line + "\n")

    debug = info = warning = error = critical = msg


def console_wanted(fmt: str, err: TextIO) -> bool:
    """Whether stderr shows the console's lines instead of JSON: with `logging.format: console`, or when it is a
    terminal (a person started `ftsup run`; systemd, Slurm and pipes get JSON)."""
    try:
        return fmt == "console" or err.isatty()
    except (AttributeError, ValueError):  # a stream without a file, or one closed
        return fmt == "console"


def configure(level: str = "info", fmt: str = "json", file: Path | None = None) -> TextIO | None:
    """Set up structlog; returns the opened log file (the caller closes it) or None.

    The file always gets JSON (DESIGN.md, Contracts); stderr gets JSON too, or the console's lines where
    `console_wanted`. `file` is opened without following a link and must be a regular file of ours
    (`statedir.open_append`): a planted link cannot make the supervisor append to another file.
    Its directory must exist (the daemon creates and checks it)."""
    handle = None
    if file is not None:
        handle = io.TextIOWrapper(statedir.open_append(file), encoding="utf-8", line_buffering=True)
    sink = _Sink(sys.stderr, handle, human=console_wanted(fmt, sys.stderr))
    json_line = structlog.processors.JSONRenderer()

    def render(logger: Any, name: str, ev: Any) -> tuple[tuple[str, str | None], dict[str, Any]]:
        return (str(json_line(logger, name, ev)), console.line(ev) if sink.human else None), {}

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=lambda *args: sink,
        cache_logger_on_first_use=False,
    )
    return handle
