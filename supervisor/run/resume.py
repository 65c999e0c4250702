"""Where the next attempt resumes and on how many slots: the health probe, the checkpoint store's choice, the
batch the world size must divide (docs/design/run-loop.md, Preparing a launch).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ftsup.store import choice, durable, layout
from ftsup.store.errors import CheckpointError
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.run import capped, health
from ftsup.supervisor.run.admission import Admission
from ftsup.supervisor.run.outages import Outages
from ftsup.supervisor.state.ckptstore import Resume, StoreScanner
from ftsup.supervisor.telemetry.metrics import Metrics

_STORE_ERRORS = (OSError, CheckpointError)  # what reading the store raises while it is unreadable or mid-change
CHOICE_TIMEOUT_S = 60.0  # the resume choice waits this long for the store, then leaves it to the ranks
RECENT_FOR_DURABLE = 16  # the newest checkpoints each scan checks for the durable tier (`durable.rules.pick`)


class ResumeChoice:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        emit: Callable[..., None],
        post: Callable[[policy.Event], None],
        outages: Outages,
        metrics: Metrics,
        admission: Admission | None = None,
    ) -> None:
        """`emit(level, event, **fields)` logs an event, `post(event)` queues one for the policy; `admission` says
        whether this node joins each attempt (None: it always does)."""
        self.cfg = cfg
        self._emit = emit
        self._post = post
        self._outages = outages
        self._metrics = metrics
        self.admission = admission
        self.held_s: float | None = None  # set by `prepare`: this node does not join now, asks again in that long
        self._waiting: Callable[[], None] | None = None  # the launch this node's admission holds back
        recent = RECENT_FOR_DURABLE if cfg.checkpoint.durable is not None else 0  # what may go durable
        self.store = StoreScanner(cfg.checkpoint.dir, deep=cfg.checkpoint.verify_deep, recent=recent)  # all reads
        self._seen = (0, 0)  # (scans, errors) of the view last handed to the metrics
        self._newest: int | None = None  # the newest step seen, from the first scan on (checkpoint_found after it)
        self._present = False  # a scan found the directory: from then on, its absence is an outage
        node_local = not cfg.checkpoint.dir_shared and cfg.launch.max_nodes > 1  # the durable tier's newest commit
        self.store.with_durable_tier(durable_opener(cfg), durable_only=node_local)  # the choice reads the tier too
        if (memory := cfg.checkpoint.memory) is not None:  # its use and replicas, for the metrics
            self.store.with_memory_tier(Path(memory.tier(cfg.job.run_id).dir), memory.replicas, memory.keep_last)

    @contextlib.contextmanager
    def running(self) -> Iterator[ResumeChoice]:
        """The scanner's thread, from here on; before, it scans and chooses on the caller's thread."""
        self.store.start()
        try:
            yield self
        finally:
            self.store.close()

    def nproc_max(self) -> int:
        """Local slots at most: `launch.nproc_per_node`, with "auto" resolved by the health probe."""
        n = self.cfg.launch.nproc_per_node
        if n != "auto":
            return int(n)
        return health.probe(None, "auto", self.cfg.launch.health_timeout_s).count or 1

    def latest(self) -> layout.CheckpointInfo | None:
        return self.store.view().latest  # as last scanned: never a wait on the store

    def latest_bytes(self) -> int | None:
        latest = self.latest()
        return latest.tensor_bytes if latest else None

    def prepare_or_retry(self, attempt: int, at_most: int | None = None) -> None:
        # While the store cannot be read, wait: the resume point must come from the store, not from its absence.
        again = ("prepare", lambda: self.prepare_or_retry(attempt, at_most))
        ready = self._outages.guard(
            "checkpoint_dir",
            self.cfg.checkpoint.dir,
            lambda: self.prepare(attempt, at_most),
            errors=_STORE_ERRORS,
            retry=again,
        )
        if ready is not None:
            self._waiting = None
            self._post(ready)
        elif self.held_s is not None:  # this node does not join now: it asks again later (at once once cleared)
            self._waiting = again[1]
            self._outages.retry(again[0], again[1], delay_s=self.held_s)

    def admit_now(self) -> None:
        """Ask again at once whether this node joins the launch it holds back (an operator cleared its quarantine)."""
        if self._waiting is not None:
            self._outages.retry("prepare", self._waiting, delay_s=0.0)

    def prepare(self, attempt: int, at_most: int | None = None) -> policy.LaunchReady | None:
        """The launch's inputs; None when this node does not join now (its admission said why; `held_s`: the
        seconds until it asks again)."""
        ln = self.cfg.launch
        self.held_s, ran = None, None
        if self.admission is not None:
            ran, self.held_s = self.admission.admit(attempt)
            if self.held_s is not None:
                return None
        elif ln.health_command:
            ran = capped.run(ln.health_command, ln.health_timeout_s)
        h = health.probe(ran, ln.nproc_per_node, ln.health_timeout_s)
        if h.count is None:
            # A blind probe must not look healthy: the policy keeps the last known world size.
            self._emit("warning", "health_probe_failed", attempt=attempt, reason=h.detail, source=h.source)
        else:
            self._emit("info", "health_probed", attempt=attempt, source=h.source, slots=list(h.slots or ()))
        step, meta, kind = self._choose_checkpoint(attempt, at_most)
        samples = meta.get("samples")
        samples = samples if type(samples) is int and samples >= 0 else None  # the checkpoint's data position
        return policy.LaunchReady(
            h.count,
            step,
            self._batch_divisor(meta),
            at_most=at_most,
            resume_samples=samples,
            resume_final=kind == "final",
        )

    def _choose_checkpoint(self, attempt: int, at_most: int | None) -> tuple[int | None, dict[str, Any], str | None]:
        """The step to resume from, its metadata and its kind (None, {}, None: a fresh start)."""
        resume = self.store.choose(CHOICE_TIMEOUT_S, at_most, tag=attempt)  # made on the scanner's thread
        self._tell_passed(attempt, resume)
        if resume.durable_error is not None:  # the fast tier's choice alone
            self._emit("warning", "durable_choice_failed", attempt=attempt, reason=resume.durable_error)
        info = resume.picked.info
        if info is None and not resume.answered and at_most is not None:
            # The ranks' own load picks, but never past the rollback's bound (FTSUP_RESUME_STEP is an upper bound).
            self._emit("warning", "checkpoint_chosen", attempt=attempt, step=at_most, reason=resume.why_no_checkpoint)
            return at_most, {}, None
        if info is None:
            reason = resume.why_no_checkpoint
            memory = self.cfg.checkpoint.memory
            if resume.answered and memory is not None and memory.replicas > 0 and self.cfg.launch.max_nodes > 1:
                reason = (
                    "no checkpoint on this node: its ranks load the newest the peers' memories hold, else start fresh"
                )
            level = "info" if resume.quiet else "warning"
            self._emit(level, "checkpoint_chosen", attempt=attempt, step=None, reason=reason)
            return None, {}, None
        self._emit(
            "info",
            "checkpoint_chosen",
            attempt=attempt,
            step=info.step,
            kind=info.kind,
            tier=resume.tier,
            path=info.path,
        )
        return info.step, resume.metadata, info.kind

    def _tell_passed(self, attempt: int, resume: Resume, **late: Any) -> None:
        """Log what a choice quarantined, skipped or abandoned on its way (`late`: fields of a choice made after
        its attempt stopped waiting for it)."""
        for p in resume.picked.passed:
            quarantined = p.action == choice.QUARANTINED  # else skipped: `path` is where it lies now either way
            level, path = ("error", p.moved_to) if quarantined else ("warning", p.path)
            event = "checkpoint_quarantined" if quarantined else "checkpoint_skipped"
            self._emit(level, event, attempt=attempt, step=p.step, reason=p.reason, path=path, **late)
        for p in resume.abandoned:
            level = "warning" if p.action == choice.ABANDONED else "error"  # one not renamed stays a resume point
            self._emit(
                level,
                "checkpoint_abandoned",
                attempt=attempt,
                step=p.step,
                reason=p.reason,
                path=p.path,
                moved_to=p.moved_to,
                **late,
            )

    def _batch_divisor(self, meta: dict[str, Any]) -> int | None:
        g = self.cfg.launch.global_batch or meta.get("global_batch")
        b = self.cfg.launch.micro_batch or meta.get("micro_batch")
        if isinstance(g, int) and g > 0:
            return g // b if isinstance(b, int) and b > 0 and g % b == 0 else g
        return None

    def refresh_metrics(self) -> None:
        """Hand the scanner's latest view to the metrics (no I/O here); a failed scan is an outage. A resume choice
        that came after its attempt stopped waiting (`CHOICE_TIMEOUT_S`) is logged now: what it renamed."""
        for attempt, late in self.store.take_late():
            self._tell_passed(attempt, late, late=True)
        view = self.store.view()
        scans, errors = self._seen
        if (view.scans, view.errors) == (scans, errors):
            return
        self._seen = (view.scans, view.errors)
        for _ in range(view.errors - errors):
            self._outages.failed(
                "checkpoint_dir", self.cfg.checkpoint.dir, view.last_exception or OSError(view.last_error)
            )
        if view.scans - scans > view.errors - errors and view.missing and self._present:
            # Gone since a scan saw it: an outage until the ranks' next save makes it again (or a person does).
            gone = OSError(None, "vanished, or something else is in its place; the ranks' next save makes it again")
            gone.filename = str(self.cfg.checkpoint.dir)
            self._outages.failed("checkpoint_dir", self.cfg.checkpoint.dir, gone)
        elif view.scans - scans > view.errors - errors:  # a scan since then went through
            self._present = self._present or not view.missing
            self._outages.ok("checkpoint_dir")
            step = view.latest.step if view.latest else -1
            if self._newest is not None and step > self._newest and view.latest:
                self._emit("info", "checkpoint_found", step=step, kind=view.latest.kind)
            self._newest = step if self._newest is None else max(self._newest, step)
        self._metrics.checkpoint(view.latest, view.committed)
        self._metrics.memory_tier(view.memory)


def durable_opener(cfg: JobConfig) -> Callable[[], durable.DurableTier] | None:
    """An opener of the durable tier `checkpoint.durable` names (None without one): the resume choice opens it for
    each choice, on the store scanner's thread."""
    spec = cfg.checkpoint.durable
    if spec is None:
        return None
    return functools.partial(durable.open_tier, spec.url, spec.options())
