"""The durable tier's uploader: committed local checkpoints copied to a durable tier on a thread of its own.

The node's supervisor, which never imports torch and outlives a crashed rank, hands it each committed checkpoint of
the fast tier that should become durable (`submit`); the thread uploads them one at a time, the newest first (an
emergency checkpoint must not wait behind older periodic ones), through `ftsup.store.durable`. A tier that fails
(`DurableTierError`: the store down, connections cut, credentials refused) is tried again after a backoff
(`backoff_initial_s`, doubling up to `backoff_max_s`), and each try resumes the upload where the last one stopped: the
training never waits on it. A checkpoint that cannot go (its local copy gone or not matching its manifest, the step
committed there with other content) is dropped and reported. Each outcome goes to `on_outcome` (the caller logs and
counts it); `status()` says what is durable, pending and failing; `wait_durable` is for a caller that must know (an
eviction's deadline); `close()` stops it at the next part and joins the thread (what was sent is kept for the next
upload of that checkpoint).

Not here: which checkpoints go durable, logging and metrics (the caller's), the store's protocol (`ftsup.store`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ftsup.store import durable, layout
from ftsup.store.errors import CheckpointError, DurableTierError


@dataclass(frozen=True)
class Outcome:
    """How one checkpoint's upload ended: committed (or already there), or dropped with the reason."""

    step: int
    path: str
    committed: bool
    attempts: int
    duration_s: float
    report: durable.UploadReport | None = None
    error: str | None = None


@dataclass(frozen=True)
class UploaderStatus:
    newest_durable: int | None
    """The newest step this uploader made durable (or found committed there)."""
    pending: tuple[int, ...]
    """Steps waiting, the next first."""
    uploading: int | None
    last_error: str | None
    """The tier's last failure while it is being retried; None once an upload went through."""


class _Stopped(Exception):
    """Raised from the part hook: the uploader is closing."""


class Uploader:
    def __init__(
        self,
        tier: durable.DurableTier,
        *,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        on_outcome: Callable[[Outcome], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError("backoff_initial_s must be positive and at most backoff_max_s")
        self.tier = tier
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.on_outcome = on_outcome
        self.clock = clock
        self._cond = threading.Condition()
        self._pending: dict[int, Path] = {}
        self._durable: set[int] = set()
        self._uploading: int | None = None
        self._last_error: str | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="ftsup-durable-upload", daemon=True)
        self._thread.start()

    def submit(self, ckpt_dir: str | Path) -> None:
        """Queue the committed local checkpoint `ckpt_dir` (a `step-N` directory); never blocks, never raises for
        what the upload will find (a step already durable or queued is not queued again)."""
        path = Path(ckpt_dir)
        step = layout.parse_step_dirname(path.name)
        if step is None:
            raise ValueError(f"{path}: not a committed checkpoint directory (step-NNNNNNNNN)")
        with self._cond:
            if self._closing or step in self._durable or step == self._uploading:
                return
            self._pending[step] = path
            self._cond.notify_all()

    def status(self) -> UploaderStatus:
        with self._cond:
            return UploaderStatus(
                newest_durable=max(self._durable, default=None),
                pending=tuple(sorted(self._pending, reverse=True)),
                uploading=self._uploading,
                last_error=self._last_error,
            )

    def wait_durable(self, step: int, timeout_s: float) -> bool:
        """Whether `step` became durable within `timeout_s` (False at once once it is neither queued nor uploading)."""
        deadline = self.clock() + timeout_s
        with self._cond:
            while step not in self._durable:
                left = deadline - self.clock()
                if left <= 0 or (step not in self._pending and step != self._uploading):
                    return False
                self._cond.wait(left)
            return True

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop at the next part (nothing new starts), and join the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                step = max(self._pending)
                path = self._pending.pop(step)
                self._uploading = step
            outcome = self._upload(step, path)
            with self._cond:
                self._uploading = None
                if outcome is not None and outcome.committed:
                    self._durable.add(step)
                self._cond.notify_all()
            if outcome is not None and self.on_outcome is not None:
                try:
                    self.on_outcome(outcome)
                except Exception:  # noqa: BLE001 - a reporter that fails must not stop every later upload
                    pass

    def _upload(self, step: int, path: Path) -> Outcome | None:
        """Upload until it goes through or cannot; None when closed meanwhile."""
        started = self.clock()
        delay = self.backoff_initial_s
        attempts = 0
        while True:
            attempts += 1
            try:
                report = self.tier.upload(path, on_part=self._check_closing)
            except _Stopped:
                return None
            except DurableTierError as e:  # the tier failed: the same upload is tried again, resuming
                with self._cond:
                    self._last_error = str(e)
                    if self._cond.wait_for(lambda: self._closing, timeout=delay):
                        return None
                delay = min(delay * 2, self.backoff_max_s)
                continue
            except (CheckpointError, OSError) as e:  # this checkpoint cannot go: reported, dropped
                return Outcome(step, str(path), False, attempts, self.clock() - started, error=str(e))
            with self._cond:
                self._last_error = None
            return Outcome(step, str(path), True, attempts, self.clock() - started, report=report)

    def _check_closing(self, rel: str, number: int) -> None:
        if self._closing:
            raise _Stopped()
