"""What wakes the daemon's loop and what it reads there each tick: signals, the eviction watchers, the heartbeat
channel (docs/design/run-loop.md, What wakes the loop). It decides nothing.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.eviction.notices import Blind, Notice, Seeing, from_signal
from ftsup.supervisor.eviction.providers import WatchError
from ftsup.supervisor.eviction.runner import WatcherThreads
from ftsup.supervisor.eviction.setup import build_watchers
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.run import systemd
from ftsup.supervisor.run.heartbeat import Beat, HeartbeatReceiver
from ftsup.supervisor.run.wakeup import Wakeup

OPERATOR_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})  # a stop, unless an eviction signal
DROPS_LOG_EVERY_S = 10.0


class EventSources:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        clock: Callable[[], float],
        emit: Callable[..., None],
        dropped: Any,
        state_bytes: Callable[[], int | None],
        upload_s: Callable[[int | None], float | None] | None = None,
    ) -> None:
        """`emit(level, event, **fields)` logs an event; `dropped` counts dropped heartbeats by reason (a prometheus
        Counter); `state_bytes()` is the size of the latest checkpoint as last seen, to estimate a save;
        `upload_s(state_bytes)` the time its upload to the durable tier takes (None: no durable tier)."""
        self.cfg = cfg
        self._clock = clock
        self._emit = emit
        self._dropped = dropped
        self._state_bytes = state_bytes
        self._upload_s = upload_s
        self.noticed: dict[str, Notice] = {}
        self._wakeup: Wakeup | None = None
        self._watchers: WatcherThreads | None = None
        self._receiver: HeartbeatReceiver | None = None

    @contextlib.contextmanager
    def running(self, runtime_dir: Path) -> Iterator[EventSources]:
        ev = self.cfg.eviction
        with contextlib.ExitStack() as stack:
            self._wakeup = stack.enter_context(Wakeup(OPERATOR_SIGNALS | {getattr(signal, n) for n in ev.signals}, []))
            self._watchers = WatcherThreads(build_watchers(ev), ev.poll_interval_s, wake=self._wakeup.writer).start()
            stack.callback(self._watchers.close)
            self._receiver = stack.enter_context(HeartbeatReceiver(runtime_dir, counter=self._dropped))
            yield self

    def wait(self, timeout: float) -> None:
        """Until a signal, a watcher's report or the timeout, whichever comes first."""
        assert self._wakeup is not None
        self._wakeup.wait(timeout)

    def events(self) -> list[policy.Event]:
        """The signals caught and the watchers' reports since the last call, as the policy's events, oldest first."""
        assert self._wakeup is not None and self._watchers is not None
        events = [self._signal_event(name) for name in self._wakeup.signals()]
        for report in self._watchers.drain():
            if (event := self.report(report)) is not None:
                events.append(event)
        return events

    def beats(self, admit: Callable[[int], bool], vet: Callable[[Beat], str | None]) -> list[Beat]:
        """The valid heartbeats waiting from senders that `admit(pid)` lets in, each that `vet(beat)` does not drop;
        drops are logged now and then."""
        assert self._receiver is not None
        beats = self._receiver.drain(admit=admit, vet=vet)
        if (dropped := self._receiver.drops_to_log(self._clock(), every_s=DROPS_LOG_EVERY_S)) is not None:
            self._emit("warning", "heartbeats_dropped", **dropped)
        return beats

    def report(self, report: Notice | Blind | Seeing) -> policy.EvictionNoticed | None:
        """A watcher's report: a notice is an event for the policy; blindness and recovery are only logged."""
        if isinstance(report, Notice):
            return self._notice_event(report)
        if isinstance(report, Blind):
            # A blind watcher must not look healthy: say so; the eviction state is unknown.
            self._emit("warning", "watcher_went_blind", source=report.source, reason=report.reason)
        else:
            self._emit("info", "watcher_recovered", source=report.source)
        return None

    def ack(self, source: str) -> None:
        """Tell the source of the notice that the job is ready to go (Azure: StartRequests)."""
        notice = self.noticed.get(source)
        if notice is None or self._watchers is None:
            return
        try:
            self._watchers.ack(notice)
        except WatchError as e:
            self._emit("warning", "watcher_went_blind", source=source, reason=f"acknowledgement failed: {e}")

    def _signal_event(self, name: str) -> policy.Event:
        if name in self.cfg.eviction.signals:
            return self._notice_event(from_signal(name, time.time(), self.cfg.eviction.default_deadline_s))
        return policy.OperatorStop(name)

    def _notice_event(self, notice: Notice) -> policy.EvictionNoticed:
        self.noticed[notice.source] = notice
        deadline = self._clock() + (notice.deadline_unix - time.time())  # wall clock -> the loop's clock
        systemd.extend_timeout(max(1.0, notice.deadline_unix - time.time()) + self.cfg.restart.stop_grace_s)
        size = self._state_bytes()
        upload = self._upload_s(size) if self._upload_s is not None else None
        return policy.EvictionNoticed(notice.source, deadline, notice.detail, notice.advisory, size, upload)
