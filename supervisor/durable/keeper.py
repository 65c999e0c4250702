"""The durable tier in the daemon: committed checkpoints handed to the uploader, its outcomes logged and counted,
the tier's retention, and the waits at the job's end (docs/design/durable-uploads.md, The keeper).
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ftsup.store import durable, layout, pins
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.durable import rules as durable_rules
from ftsup.supervisor.durable.upload import Outcome, Uploader
from ftsup.supervisor.state.ckptstore import StoreView
from ftsup.supervisor.telemetry.metrics import Metrics

BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0
POLL_S = 0.1  # how often a wait for durability reports what the uploader did
UPLOAD_NICE = 10  # the uploader's threads yield the CPU to the ranks: training never waits on the tier
CLOSE_S = 5.0  # the longest the daemon's end waits for an upload to stop at its next part (it resumes later)


def _error_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 500 else text[:497] + "..."


class DurableKeeper:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        emit: Callable[..., None],
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if cfg.checkpoint.durable is None:
            raise ValueError("no checkpoint.durable in this config")
        self.cfg = cfg
        self.tier_cfg = cfg.checkpoint.durable
        self._emit = emit
        self._metrics = metrics
        self._clock = clock
        self._wall = wall
        self._todo: collections.deque[Callable[[], None]] = collections.deque()  # from the uploader's thread
        self._picks = durable_rules.Picks()
        self._seen = (0, 0)  # (scans, errors) of the store view last observed
        self._rates: list[float] = []  # measured upload throughputs, bytes per second, the newest last
        self.newest: int | None = None  # the newest durable step known (listed there, or committed by this one)
        self._newest_unix = wall()  # when it was committed (until one is: this supervisor's start)
        self._failing: str | None = None  # the last failed try's error, until an upload goes through
        self.uploader: Uploader | None = None
        self._tier: durable.DurableTier | None = None
        self._own_newest = -1  # the newest step this run made durable (the uploader's thread's)
        self._parts: set[int] = set()  # steps whose part this node uploaded, waiting for the others' (logged)

    @property
    def url(self) -> str:
        return self.tier_cfg.url

    @property
    def node(self) -> str | None:
        """This node, where each node keeps its own fast tier (it uploads its part of each checkpoint)."""
        return None if self.cfg.checkpoint.dir_shared else self.cfg.launch.node_id

    @contextlib.contextmanager
    def running(self) -> Iterator[DurableKeeper]:
        """The tier and its uploader, from here on; closed (the uploader joined) when this ends."""
        tier = durable.open_tier(self.tier_cfg.url, self.tier_cfg.options())
        self._tier = tier
        try:
            self.uploader = Uploader(
                tier,
                backoff_initial_s=BACKOFF_INITIAL_S,
                backoff_max_s=BACKOFF_MAX_S,
                on_outcome=lambda o: self._todo.append(lambda: self._outcome(o)),
                on_started=lambda step, path: self._todo.append(lambda: self._started(step, path)),
                on_retry=lambda step, why, wait: self._todo.append(lambda: self._retry(step, why, wait)),
                housekeeping=self._housekeeping,
                max_pending=max(self.tier_cfg.keep_last, 2),
                nice=UPLOAD_NICE,
                node=self.node,
                hold_s=self.tier_cfg.hold_while_saving_s,
                on_waiting=lambda step, why, wait: self._todo.append(lambda: self._waiting(step, why, wait)),
            )
            try:
                yield self
            finally:
                self.uploader.close(CLOSE_S)
                self.poll()
        finally:
            tier.close()

    # ------------------------------------------------------------------ on the daemon's loop

    def observe(self, view: StoreView) -> None:
        """Submit what `durable_rules.pick` picks of the newest scan that went through."""
        scans, errors = self._seen
        if (view.scans, view.errors) == (scans, errors):
            return
        self._seen = (view.scans, view.errors)
        if view.scans - scans <= view.errors - errors:
            return  # no scan went through since the last look
        self._picks, chosen, others = durable_rules.candidates(self.tier_cfg, self._picks, view.recent)
        for info in chosen:
            self.submit(Path(info.path))
        for info in others if self.node is not None else []:  # to follow rank 0's node's pick (`follows`)
            if self.uploader is not None:
                self.uploader.submit(Path(info.path), picked=False)

    def saved(self, step: int, kind: str | None, *, fallback: bool = False) -> None:
        """The ranks reported a checkpoint of `step` committed for an eviction (in `fallback_dir` with `fallback`:
        `checkpoint.dir` refused it): submitted now, urgent."""
        root = self.tier_cfg.fallback_dir if fallback and self.tier_cfg.fallback_dir else self.cfg.checkpoint.dir
        if self.tier_cfg.wants(kind):
            self.submit(Path(root) / layout.step_dirname(step), urgent=True)

    def submit(self, path: Path, *, urgent: bool = False) -> None:
        if self.uploader is not None:
            self.uploader.submit(path, urgent=urgent)

    def poll(self) -> None:
        """Log and count what the uploader's thread reported; refresh the gauges."""
        while self._todo:
            self._todo.popleft()()
        st = self.uploader.status() if self.uploader is not None else None
        pending = (len(st.pending) + (st.uploading is not None)) if st is not None else 0
        rate = self._rates[-1] if self._rates else None
        self._metrics.durable(newest_step=self.newest, newest_unix=self._newest_unix, pending=pending, rate=rate)

    def estimate_s(self, state_bytes: int | None) -> float | None:
        """How long uploading a checkpoint of `state_bytes` is expected to take (`durable_rules`)."""
        return durable_rules.upload_estimate_s(state_bytes, self._rates)

    def wait_durable(self, step: int | None, timeout_s: float, why: str) -> bool:
        """Wait up to `timeout_s` for `step` to be durable (polling the uploader's reports meanwhile); when it is
        not, say so and name the newest durable checkpoint. `why` says what waits (an eviction, the job's end)."""
        if step is None or self.uploader is None:
            self._missed(None, why, "no checkpoint was saved for it")
            return False
        end = self._clock() + max(0.0, timeout_s)
        done = False
        while not done:
            left = end - self._clock()
            done = self.uploader.wait_durable(step, max(0.0, min(POLL_S, left)))
            self.poll()
            if left <= 0:
                break
            st = self.uploader.status()
            if not done and step not in st.pending and st.uploading != step:
                break  # dropped: its outcome was just logged
        if not done:
            self._missed(step, why, f"not durable within {timeout_s:.1f}s")
        return done

    def wait_idle(self, timeout_s: float, why: str, final: int) -> bool:
        """Wait up to `timeout_s` until nothing waits for the tier (what was picked is durable or dropped); whether
        `final` is durable then (when it is not, say so, naming the newest durable checkpoint)."""
        if self.uploader is None:
            return False
        end = self._clock() + max(0.0, timeout_s)
        while True:
            self.poll()
            st = self.uploader.status()
            left = end - self._clock()
            if (set(st.pending) <= set(st.following) and st.uploading is None) or left <= 0:
                break
            self.uploader.wait_durable(st.uploading if st.uploading is not None else st.pending[0], min(POLL_S, left))
        done = self.uploader.wait_durable(final, 0.0)
        if not done:
            self._missed(final, why, f"not durable within {timeout_s:.1f}s")
        return done

    def status(self) -> dict[str, Any]:
        """For the journal and `ftsup status`: the tier, its newest durable step, what waits, the last error."""
        st = self.uploader.status() if self.uploader is not None else None
        return {
            "url": self.url,
            "newest_step": self.newest,
            "newest_unix": self._newest_unix if self.newest is not None else None,
            "pending": list(st.pending) if st is not None else [],
            "uploading": st.uploading if st is not None else None,
            "last_error": self._failing,
        }

    def _tier_event(self, level: str, event: str, step: int | None, url: str | None = None, **fields: Any) -> None:
        """An event of this tier: its `step` and `url` (default: the tier's), then `fields`."""
        self._emit(level, event, step=step, url=self.url if url is None else url, **fields)

    def _missed(self, step: int | None, why: str, detail: str) -> None:
        newest = f"step {self.newest}" if self.newest is not None else "none known"
        what = f"the checkpoint of step {step} is {detail}" if step is not None else detail
        if self._failing is not None and step is not None:
            what += f" (waiting for: {self._failing})"
        self._tier_event(
            "warning",
            "durable_deadline_missed",
            step,
            newest_durable_step=self.newest,
            reason=f"{why}: {what}; the newest durable checkpoint in {self.url} is {newest}",
        )

    def _started(self, step: int, path: str) -> None:
        self._tier_event("info", "durable_upload_started", step, path=path)

    def _retry(self, step: int, why: str, wait: float) -> None:
        self._failing = why
        self._tier_event("warning", "durable_upload_failed", step, reason=why, retry_in_s=round(wait, 3))

    def _waiting(self, step: int, why: str, wait: float) -> None:
        """This node's part of `step` is in the tier; its commit waits for the other nodes' (logged once a step)."""
        self._failing = why
        if step not in self._parts:
            self._parts = {*sorted(self._parts)[-16:], step}
            self._tier_event(
                "info", "durable_part_uploaded", step, node=self.node, reason=why, retry_in_s=round(wait, 3)
            )

    def _outcome(self, o: Outcome) -> None:
        if o.skipped:
            return  # not this node's to upload, by the pick every node agrees on
        if not o.committed or o.report is None:
            reason = o.error or "not uploaded"
            self._tier_event("error", "durable_dropped", o.step, path=o.path, attempts=o.attempts, reason=reason)
            return
        r = o.report
        rate = durable_rules.measured_rate(r.bytes_sent, o.send_s)
        if rate is not None:
            self._rates = [*self._rates, rate][-durable_rules.RATE_HISTORY :]
        self._failing = None
        self._known(o.step, self._wall())
        self._tier_event(
            "info",
            "durable_committed",
            o.step,
            r.url,  # the step's own
            outcome=r.outcome,
            node=self.node,
            files=r.files,
            bytes=r.bytes_total,
            bytes_sent=r.bytes_sent,
            parts_kept=r.parts_kept,
            attempts=o.attempts,
            duration_s=round(o.duration_s, 3),
            held_s=round(o.held_s, 3),
            throughput_bytes_per_s=round(rate) if rate is not None else None,
        )

    def _known(self, step: int, when: float | None) -> None:
        if self.newest is None or step > self.newest:
            self.newest = step
            if when is not None:
                self._newest_unix = when

    # ------------------------------------------------------------------ on the uploader's thread

    def _housekeeping(self, committed: int | None) -> None:
        """At the start (None): the newest durable checkpoint already there. After a commit: retention."""
        tier = self._tier
        if tier is None:
            return
        try:
            listing = tier.list_checkpoints(deep=False)
        except Exception as e:  # noqa: BLE001 - the tier's failure is logged; the next commit lists again
            self._retention_failed(committed, f"listing: {_error_line(e)}")
            return
        good = [c for c in listing.checkpoints if c.consistent]
        if good:
            newest = good[-1]
            self._todo.append(lambda: self._known(newest.step, newest.created_unix))
        if committed is None:
            return
        self._own_newest = max(self._own_newest, committed)
        keep_older = self.cfg.anomaly.detection_window_steps if self.cfg.anomaly.enabled else 0
        pinned = pins.read_pins(self.cfg.checkpoint.dir)
        if not pinned.readable:
            why = "; ".join(str(p) for p in pinned.problems)
            self._retention_failed(committed, f"the pins cannot be read ({why}): nothing is deleted")
            return
        doomed = durable_rules.victims(
            ((c.step, c.consistent) for c in listing.checkpoints),
            keep_last=self.tier_cfg.keep_last,
            keep_older_than_steps=keep_older,
            newest=self._own_newest,
            pinned=pinned.kept,
        )
        for step in doomed:
            again = pins.read_pins(self.cfg.checkpoint.dir)  # an operator may pin one meanwhile
            if step in again.kept or not again.readable:
                continue
            try:
                removed = tier.delete(step)
            except Exception as e:  # noqa: BLE001 - one failed deletion must not stop the uploads
                self._retention_failed(step, _error_line(e))
                continue
            self._deleted(step, removed, f"durable retention (keep_last {self.tier_cfg.keep_last})")
        if self.node is not None and len(good) >= 2:
            self._sweep(tier, {c.step for c in listing.checkpoints}, good[-1].step, good[-2].step)

    def _sweep(self, tier: durable.DurableTier, committed: set[int], newest: int, below: int) -> None:
        """Delete what this job's nodes wrote for the steps older than `below` (the commit before the newest,
        `newest`) that were never committed (`DurableTier.sweep`: the objects their markers name, and those
        markers). Another node still uploads a step older than the newest commit (newest first: the leader picked
        it); one older than two commits it has dropped (`ftsup/store/DESIGN.md`, Node-local fast tiers)."""
        try:
            manifest, _ = tier.manifest(newest)
            job = {*(manifest.nodes or ()), *([self.node] if self.node else [])}
            stale = [s for s in tier.committed_steps() if s < below and s not in committed]
        except Exception as e:  # noqa: BLE001 - the tier's failure is logged; the next commit sweeps again
            self._retention_failed(newest, f"sweep: {_error_line(e)}")
            return
        for step in stale:
            try:
                removed = tier.sweep(step, job)
            except Exception as e:  # noqa: BLE001 - one failed deletion must not stop the uploads
                self._retention_failed(step, _error_line(e))
                continue
            if removed:
                self._deleted(step, removed, f"never committed, superseded by step {newest}")

    def _later(self, level: str, event: str, **fields: Any) -> None:
        """An event for the loop's thread to log (logging and metrics are the loop's)."""
        self._todo.append(lambda: self._emit(level, event, **fields))

    def _retention_failed(self, step: int | None, reason: str) -> None:
        self._later("warning", "durable_retention_failed", step=step, reason=reason)

    def _deleted(self, step: int, objects: int, reason: str) -> None:
        self._later("info", "durable_deleted", step=step, url=self.url, objects=objects, reason=reason)
