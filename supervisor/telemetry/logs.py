"""Structured logs: one JSON object per line, and the one list of event names (`EVENTS`).

`configure()` is called once by `ftsup run`; everything else uses `structlog.get_logger()`
(docs/design/telemetry.md, Logs).
"""

from __future__ import annotations

import io
import logging
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

import structlog

from ftsup.supervisor import statedir
from ftsup.supervisor.telemetry import console

_EVENT_GROUPS = (
    # the supervisor's own life: its start and end, the journal, storage, the metrics endpoint
    "supervisor_started supervisor_exited supervisor_crashed journal_adopted journal_ignored leftovers_stopped",
    "storage_failed storage_recovered metrics_scrape_failed",
    # preparing and launching an attempt
    "health_probed health_probe_failed checkpoint_found checkpoint_chosen checkpoint_quarantined checkpoint_skipped",
    "checkpoint_abandoned world_size_chosen launch_failed spare_agent_parked spare_agent_used spare_agent_failed",
    "durable_choice_failed",  # the durable tier had no part in a resume choice (it failed or did not answer)
    # this node before each attempt: its checks, its quarantine, a hot spare's wait in the rendezvous
    "node_checked launch_deferred node_fault_recorded node_quarantined quarantine_expired quarantine_cleared",
    "quarantine_ignored quarantine_clear_ignored standby_joined standby_released",
    # the running attempt, its failures and what follows them
    "workers_launched workers_restarted first_step_reached heartbeats_dropped workers_stopped orphans_found",
    "heartbeat_timed_out progress_timed_out startup_timed_out worker_exited stop_requested",
    "restart_scheduled crash_loop_detected restart_budget_exhausted job_succeeded job_failed job_stopped",
    "progress_lost",  # a relaunch that starts behind the steps earlier attempts reported
    # evictions and checkpoints
    "eviction_noticed save_requested save_skipped checkpoint_committed requeue_requested requeue_failed",
    "emergency_save_failed emergency_tiers_reached checkpoint_dir_recreated peer_eviction_followed",
    "watcher_went_blind watcher_recovered",
    "checkpoint_pinned checkpoint_unpinned",  # by `ftsup ckpt pin|unpin`, not the daemon
    # training health
    "anomaly_detected anomaly_escalated rollback_started rollback_requested rollback_refused rollback_request_ignored",
    "data_skipped straggler_detected straggler_recovered throughput_drift_detected throughput_drift_recovered",
    # the durable tier
    "durable_upload_started durable_committed durable_upload_failed durable_dropped durable_deleted",
    "durable_retention_failed durable_deadline_missed",
    # the evidence of a hang, a straggler or an operator's request: every rank's stacks, in an incident record
    "incident_recorded incident_failed capture_requested capture_request_ignored",
)
EVENTS = frozenset(name for group in _EVENT_GROUPS for name in group.split())

OUTPUT_LOCK = threading.Lock()
"""Held while a line goes to the terminal: the supervisor's own (stderr) and the ranks' it echoes (stdout,
`run.echo`), so that where both go to one terminal or journal no line is cut by another."""
LOCK_WAIT_S = 1.0  # the longest the supervisor's own line waits for the echo: a stalled stdout never stalls the loop

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
            locked = OUTPUT_LOCK.acquire(timeout=LOCK_WAIT_S)
            try:
                self.err.write(shown + "\n")
                self.err.flush()
            finally:
                if locked:
                    OUTPUT_LOCK.release()
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
