"""After an eviction's emergency save: ask the batch system to run the job again.

A failure is logged, never raised: the job is evicted either way, and its checkpoint is committed.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence


def requeue(command: Sequence[str] | None, environ: Mapping[str, str], emit: Callable[..., None]) -> None:
    """`emit(level, event, **fields)` logs an event (the daemon's log-and-count)."""
    argv = list(command or ())
    job_id = environ.get("SLURM_JOB_ID")
    if not argv and job_id:
        argv = ["scontrol", "requeue", job_id]
    if not argv:
        return
    emit("info", "requeue_requested", reason=" ".join(argv))
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        emit("error", "requeue_failed", reason=str(e))
        return
    if out.returncode != 0:
        emit("error", "requeue_failed", reason=f"{argv[0]} exited {out.returncode}: {out.stderr.strip()[:300]}")
