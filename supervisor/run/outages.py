"""Storage outages the supervisor rides out, and the retries of what they made fail: logged once per run of
failures, counted, retried with backoff; never a reason to end the job (docs/design/run-loop.md, Outages).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ftsup.supervisor.errors import error_line
from ftsup.supervisor.telemetry.metrics import STORAGE_PURPOSES

_T = TypeVar("_T")
RETRY_INITIAL_S = 1.0
RETRY_MAX_S = 30.0
LOG_EVERY_S = 60.0


class Outages:
    def __init__(self, emit: Callable[..., None], count: Callable[[str], None], clock: Callable[[], float]) -> None:
        """`emit(level, event, **fields)` logs an event, `count(purpose)` counts a failure, `clock()` is the
        loop's clock."""
        self._emit = emit
        self._count = count
        self._clock = clock
        self._failing: dict[str, tuple[float, int]] = {}  # purpose -> (last logged at, failures since)
        self._retries: dict[str, tuple[float, Callable[[], None]]] = {}  # what -> (when, how) to try again
        self._delay: dict[str, float] = {}  # what -> the last delay, until done

    def guard(
        self,
        purpose: str,
        path: object,
        op: Callable[[], _T],
        *,
        errors: tuple[type[BaseException], ...] = (OSError,),
        retry: tuple[str, Callable[[], None]] | None = None,
    ) -> _T | None:
        """`op()`, or None when it raised one of `errors`: then the failure is counted and logged, and `retry`
        (what, again), if given, is scheduled. Success logs the recovery and cancels a pending retry of `what`."""
        try:
            result = op()
        except errors as e:
            self.failed(purpose, path, e)
            if retry is not None:
                self.retry(*retry)
            return None
        if retry is not None:
            self.done(retry[0])
        self.ok(purpose)
        return result

    def failed(self, purpose: str, path: object, error: BaseException) -> None:
        self._count(purpose)
        now = self._clock()
        logged_at, since = self._failing.get(purpose, (None, 0))
        if logged_at is not None and now - logged_at < LOG_EVERY_S:
            self._failing[purpose] = (logged_at, since + 1)
            return
        self._failing[purpose] = (now, 0)
        fields: dict[str, Any] = {"purpose": purpose, "path": str(path), "failures_since_last_line": since}
        self._emit(
            "warning", "storage_failed", reason=f"{STORAGE_PURPOSES[purpose]}: {error_line(error)}; retrying", **fields
        )

    def ok(self, purpose: str) -> None:
        if self._failing.pop(purpose, None) is not None:
            self._emit("info", "storage_recovered", purpose=purpose, reason=f"{STORAGE_PURPOSES[purpose]} works again")

    def retry(self, what: str, again: Callable[[], None], delay_s: float | None = None) -> None:
        """Run `again()` later: after `delay_s` when given (its caller keeps the backoff), else after the next of
        this outage's doubling delays."""
        if delay_s is None:
            delay_s = self._delay[what] = min(RETRY_MAX_S, self._delay.get(what, RETRY_INITIAL_S / 2) * 2)
        self._retries[what] = (self._clock() + delay_s, again)

    def done(self, what: str) -> None:
        self._retries.pop(what, None)
        self._delay.pop(what, None)

    def due(self, what: str) -> float | None:
        """When `what` is next tried, or None when no retry of it is pending."""
        pending = self._retries.get(what)
        return None if pending is None else pending[0]

    def run_due(self) -> None:
        now = self._clock()
        for what, (when, again) in list(self._retries.items()):
            if now >= when:
                del self._retries[what]  # one that fails again schedules itself, with a longer delay
                again()
