"""The daemon's journal keeping: the node's journal written as the loop goes, and adopted when it starts
(docs/design/run-loop.md, The journal kept). The record's format and checks are `state.journal`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from ftsup import procs
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.run.outages import Outages
from ftsup.supervisor.state.journal import Journal, JournalError, JournalRecord


class JournalKeeper:
    def __init__(
        self,
        cfg: JobConfig,
        path: Path,
        snapshot: Callable[[str], JournalRecord],
        *,
        outages: Outages,
        emit: Callable[..., None],
        written: Callable[[JournalRecord], None] | None = None,
    ) -> None:
        """`written(record)`, when given, is called with each record once it is on disk."""
        self.cfg = cfg
        self._written = written
        self.file = Journal(path)
        self._snapshot = snapshot
        self._outages = outages
        self._emit = emit
        self.adopted = 0  # the attempt number the journal held when this supervisor started
        self.kept: JournalRecord | None = None  # that journal, when it was this job's and node's
        self.status = "starting"  # the status last written

    @property
    def path(self) -> Path:
        return self.file.path

    def write(self, status: str | None = None, *, durable: bool = True) -> None:
        """Write the journal with `status` (None: the status last written, with the rest as of now); `durable`
        False: not fsynced (it survives this process, not a crash of the node)."""
        status = self.status = self.status if status is None else status
        again = ("journal", lambda: self.write(status, durable=durable))  # a later write supersedes it
        self._outages.guard("journal", self.path, lambda: self._write(status, durable), retry=again)

    def _write(self, status: str, durable: bool) -> None:
        record = self._snapshot(status)
        self.file.write(record, durable=durable)
        if self._written is not None:
            self._written(record)

    def peek(self) -> JournalRecord | None:
        """This job's and node's journal as it is now, changing nothing; None when there is none, it is another
        job's or it cannot be used (`adopt` says why)."""
        try:
            rec = self.file.read(owner=os.geteuid())
        except JournalError:
            return None
        mine = rec is not None and (rec.run_id, rec.node_id) == (self.cfg.job.run_id, self.cfg.launch.node_id)
        return rec if mine else None

    def adopt(self) -> int:
        """Stop what a previous supervisor of this job and node left running; return its last attempt number.

        The journal is hostile input (someone may have planted it): only processes that carry the
        journaled attempt's mark of this job and node, are ours and were created since that attempt
        started are stopped. The journal's own pid list is never signalled."""
        try:
            rec = self.file.read(owner=os.geteuid())
        except JournalError as e:
            self._emit("warning", "journal_ignored", reason=str(e))
            return 0
        if rec is None:
            return 0
        self._emit(
            "info",
            "journal_adopted",
            attempt=rec.attempt,
            status=rec.status,
            world_size=rec.world_size,
            step=rec.resume_step,
            supervisor_pid=rec.supervisor_pid,
        )
        mine = (rec.run_id, rec.node_id) == (self.cfg.job.run_id, self.cfg.launch.node_id)
        self.kept = rec if mine else None
        if mine and rec.attempt_started_unix is not None:
            mark = procs.Mark(rec.run_id, rec.node_id, rec.attempt)
            since = rec.attempt_started_unix
            found = procs.find(mark, since=since, until=time.time())
            if found:
                procs.stop(lambda: procs.find(mark, since=since), self.cfg.restart.stop_grace_s)
                self._emit("warning", "leftovers_stopped", attempt=rec.attempt, pids=sorted(p.pid for p in found))
        self.adopted = rec.attempt
        return rec.attempt


def exit_status(code: int) -> str:
    """The journal's status for `ftsup run`'s exit status `code` (an escalated anomaly, 7, is "failed"; a job whose
    training finished, 9 with its final checkpoint short of the durable tier, "succeeded"; an eviction whose
    emergency save failed, 8, "evicted")."""
    statuses = {
        policy.EXIT_OK: "succeeded",
        policy.EXIT_NOT_DURABLE: "succeeded",
        policy.EXIT_EVICTED: "evicted",
        policy.EXIT_SAVE_LOST: "evicted",
        policy.EXIT_STOPPED: "stopped",
    }
    return statuses.get(code, "failed")
