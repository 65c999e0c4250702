"""Structured logs: one JSON object per line (`event`, `level`, `timestamp`, and the fixed keys
`attempt`, `world_size`, `rank`, `step`, `reason`, `duration_s` where they apply).

`configure()` is called once by `ftsup run`; everything else just uses `structlog.get_logger()`.
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

EVENTS = frozenset(
    {
        "supervisor_started", "journal_adopted", "leftovers_stopped", "health_probed",
        "health_probe_failed", "checkpoint_chosen", "checkpoint_quarantined", "checkpoint_skipped", "world_size_chosen",
        "workers_launched", "workers_restarted", "heartbeats_dropped", "journal_ignored",
        "heartbeat_timed_out", "progress_timed_out", "startup_timed_out", "worker_exited", "workers_stopped",
        "orphans_found", "restart_scheduled", "crash_loop_detected", "restart_budget_exhausted", "job_succeeded",
        "job_failed", "job_stopped", "stop_requested", "eviction_noticed", "save_requested", "checkpoint_committed",
        "save_skipped", "requeue_requested", "requeue_failed", "watcher_went_blind", "watcher_recovered",
        "supervisor_exited", "metrics_scrape_failed", "storage_failed", "storage_recovered", "launch_failed",
        "supervisor_crashed",
    }
)  # fmt: skip

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _Tee:
    """Write each line to several streams (stderr and the node's log file), skipping any that
    was closed since (the daemon closes its log file when it returns; code that logs after that
    in the same process must not fail on it)."""

    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, s: str) -> None:
        for st in self.streams:
            if not st.closed:
                st.write(s)

    def flush(self) -> None:
        for st in self.streams:
            if not st.closed:
                st.flush()


def configure(level: str = "info", fmt: str = "json", file: Path | None = None) -> TextIO | None:
    """Set up structlog; returns the opened log file (the caller closes it) or None.

    `file` is opened without following a link and must be a regular file of ours
    (`statedir.open_append`): a planted link cannot make the supervisor append to another file.
    Its directory must exist (the daemon creates and checks it)."""
    out: Any = sys.stderr
    handle = None
    if file is not None:
        handle = io.TextIOWrapper(statedir.open_append(file), encoding="utf-8", line_buffering=True)
        out = _Tee(sys.stderr, handle)
    renderer: Any = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    return handle
