"""The durable tier's uploader: committed local checkpoints copied to a durable tier on a thread of its own, newest
first, retried until they go, never in the training's way (docs/design/durable-uploads.md, The uploader).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftsup.store import durable, layout
from ftsup.store.errors import CheckpointError, DurableTierError, DurableWaitError
from ftsup.supervisor.durable.hold import SaveHold


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
    send_s: float = 0.0
    """The duration of the try that went through, less the time it was held (the tier's throughput is
    `report.bytes_sent / send_s`)."""
    held_s: float = 0.0
    """The seconds that try waited for the node's saves (`durable.hold`)."""
    skipped: bool = False
    """Not this node's to upload, by the pick every node agrees on (`DurableTier.follows`): nothing went wrong."""


@dataclass(frozen=True)
class UploaderStatus:
    newest_durable: int | None
    """The newest step this uploader made durable (or found committed there)."""
    pending: tuple[int, ...]
    """Steps waiting, the next first."""
    uploading: int | None
    last_error: str | None
    """The tier's last failure while it is being retried; None once an upload went through."""
    following: tuple[int, ...] = ()
    """Pending steps that wait for the leader's pick (which may never come), tried since the newest commit: a job's
    end does not wait for them."""


def _yield_cpu(nice: int) -> None:
    """This thread (and the upload threads it starts) `nice` steps nicer. Where the kernel groups processes by session
    for scheduling (autogroup), a thread's nice weighs only against threads of its own session, and the ranks run in
    a session of their own (the launcher's torchrun): so a process that leads its session (a supervisor started by
    systemd, a container, a daemon) also sets its session's group at least `nice`, which then weighs against the
    ranks'. In a session it does not lead (a shell's) the group is left as it is: it is not the supervisor's."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    with contextlib.suppress(OSError, ValueError):
        if os.getsid(0) != os.getpid():
            return
        with open("/proc/self/autogroup") as f:  # "/autogroup-123 nice 0"; absent without autogroup
            current = int(f.read().rpartition("nice")[2])
        if current < nice:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(min(19, nice)))


class _Stopped(Exception):
    """Raised from the part hook: the uploader is closing."""


class _Waiting(Exception):
    """Raised from an upload: this node's part is in the tier, the commit waits for the other nodes' parts; or
    (`quiet`) a periodic checkpoint waits for the node of rank 0 to pick it (nothing sent yet)."""

    def __init__(self, why: str, quiet: bool) -> None:
        super().__init__(why)
        self.quiet = quiet


class _Preempted(Exception):
    """Raised from the part hook: a newer urgent checkpoint goes first; this one waits again."""


WAIT_MAX_S = 5.0
"""The longest wait between tries of a commit that waits for other nodes' parts (they come with their uploads)."""


class Uploader:
    def __init__(
        self,
        tier: durable.DurableTier,
        *,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        on_outcome: Callable[[Outcome], None] | None = None,
        on_started: Callable[[int, str], None] | None = None,
        on_retry: Callable[[int, str, float], None] | None = None,
        housekeeping: Callable[[int | None], None] | None = None,
        max_pending: int | None = None,
        nice: int = 0,
        node: str | None = None,
        on_waiting: Callable[[int, str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        hold_s: float = 0.0,
    ) -> None:
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError("backoff_initial_s must be positive and at most backoff_max_s")
        if max_pending is not None and max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.tier = tier
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.on_outcome = on_outcome
        self.on_started = on_started  # (step, path)
        self.on_retry = on_retry  # (step, error, the wait before the next try)
        self.housekeeping = housekeeping
        self.max_pending = max_pending
        self.node = node  # a node-local job's node: its part of each checkpoint (`ftsup.store.nodes`)
        self.on_waiting = on_waiting  # (step, what its commit waits for, the wait before the next try)
        self._waits: dict[int, tuple[float, float]] = {}  # step waiting for other nodes -> (next try, its delay)
        self.nice = nice  # added to this thread's nice value (Linux: per thread, inherited by its upload threads)
        self.clock = clock
        self.hold_s = hold_s  # > 0: a non-urgent upload waits up to this long while its fast tier is being written
        self._holds: dict[Path, SaveHold] = {}  # the fast tier of the checkpoints uploaded -> its hold (this thread's)
        self._urgent: set[int] = set()  # submitted urgent: never held
        self._preempt = False
        self._cond = threading.Condition()
        self._pending: dict[int, Path] = {}
        self._unpicked: set[int] = set()  # submitted only to follow the node of rank 0's pick (`follows`)
        self._announced: set[int] = set()  # past `follows` (`on_started` told), until its outcome
        self._quiet_at: dict[int, int] = {}  # waiting for the leader's pick -> the newest durable step at its last try
        self._durable: set[int] = set()
        self._uploading: int | None = None
        self._last_error: str | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="ftsup-durable-upload", daemon=True)
        self._thread.start()

    def submit(self, ckpt_dir: str | Path, *, urgent: bool = False, picked: bool = True) -> bool:
        """Queue the committed local checkpoint `ckpt_dir` (a `step-N` directory); never blocks, never raises for
        what the upload will find. A step already durable, queued or uploading is not queued again (False). An
        `urgent` one newer than the upload in progress stops that one at its next part (it waits again). One not
        `picked` (a node-local job's) goes only where the tier's `follows` says so."""
        path = Path(ckpt_dir)
        step = layout.parse_step_dirname(path.name)
        if step is None:
            raise ValueError(f"{path}: not a committed checkpoint directory (step-NNNNNNNNN)")
        dropped: list[tuple[int, Path, bool]] = []
        with self._cond:
            if picked and step in self._pending:
                self._unpicked.discard(step)
            if self._closing or step in self._durable or step == self._uploading or step in self._pending:
                return False
            self._pending[step] = path
            if urgent:
                self._urgent.add(step)
            if not picked:
                self._unpicked.add(step)
            if urgent and self._uploading is not None and step > self._uploading:
                self._preempt = True
            while self.max_pending is not None and len(self._pending) > self.max_pending:
                oldest = min(self._pending)
                dropped.append((oldest, self._pending.pop(oldest), oldest in self._unpicked))
                self._urgent.discard(oldest)
                self._unpicked.discard(oldest)
                self._waits.pop(oldest, None)
                self._quiet_at.pop(oldest, None)
            self._cond.notify_all()
        for old, where, unpicked in dropped:
            why = f"superseded: more than {self.max_pending} checkpoints waiting, the newest go first"
            self._report(Outcome(old, str(where), False, 0, 0.0, error=why, skipped=unpicked))
        return step not in {old for old, _, _ in dropped}

    def status(self) -> UploaderStatus:
        with self._cond:
            return UploaderStatus(
                newest_durable=max(self._durable, default=None),
                pending=tuple(sorted(self._pending, reverse=True)),
                uploading=self._uploading,
                last_error=self._last_error,
                following=tuple(
                    sorted(
                        (
                            s
                            for s, at in self._quiet_at.items()
                            if s in self._pending and at == max(self._durable, default=-1)
                        ),
                        reverse=True,
                    )
                ),
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
            holds = list(self._holds.values())
        for hold in holds:
            hold.stop()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        if self.nice > 0:  # the uploads' CPU (MD5s, checksums) yields to the training processes on a busy node
            _yield_cpu(self.nice)
        self._call(self.housekeeping, None)
        while True:
            with self._cond:
                while not self._closing:
                    now = self.clock()
                    ready = [s for s in self._pending if s not in self._waits or self._waits[s][0] <= now]
                    if ready:
                        break
                    soonest = min((self._waits[s][0] for s in self._pending), default=None)
                    self._cond.wait(None if soonest is None else max(0.01, soonest - now))
                if self._closing:
                    return
                step = max(ready)
                path = self._pending.pop(step)
                self._uploading = step
                self._preempt = False
                again = step in self._waits
                picked = step not in self._unpicked
            try:
                outcome = self._upload(step, path, picked)
            except _Preempted:
                outcome = None
                with self._cond:
                    self._announced.discard(step)  # started again later
                    if step not in self._durable:
                        self._pending.setdefault(step, path)  # after the urgent one, from where it stopped
            except _Waiting as e:  # its part is there (or the leader's pick comes): other checkpoints go meanwhile
                outcome = None
                with self._cond:  # given up once a newer one is durable; one not sent yet, once it is stale
                    sent = step in self._announced
                    newer = max(self._durable, default=-1) > step if sent else self._stale(step)
                    if not newer:
                        delay = min(self._waits[step][1] * 2, WAIT_MAX_S) if again else self.backoff_initial_s
                        self._waits[step] = (self.clock() + delay, delay)
                        if not sent:
                            self._quiet_at[step] = max(self._durable, default=-1)
                        self._pending.setdefault(step, path)
                        if not e.quiet:
                            self._last_error = str(e)
                if newer:  # a newer checkpoint is durable already: superseded at once (as in `_supersede_waiting`)
                    why = "superseded: a newer checkpoint is durable; the other nodes' parts of this one did not come"
                    outcome = Outcome(step, str(path), False, 0, 0.0, error=why, skipped=not sent)
                elif not e.quiet:
                    self._call(self.on_waiting, step, str(e), delay)
            with self._cond:
                self._uploading = None
                if outcome is not None:
                    self._urgent.discard(step)
                    self._waits.pop(step, None)
                    self._unpicked.discard(step)
                    self._announced.discard(step)
                    self._quiet_at.pop(step, None)
                if outcome is not None and outcome.committed:
                    self._durable.add(step)
                self._cond.notify_all()
            if outcome is not None:
                self._report(outcome)
                if outcome.committed:
                    self._supersede_waiting(step)
                    self._call(self.housekeeping, step)

    def _supersede_waiting(self, step: int) -> None:
        """Give up the older commits that wait for other nodes' parts once `step` is durable: a part that has not
        come by then (its node gone, its copy lost with its machine) may never come, and a newer checkpoint is
        durable; one that waits for the leader's pick (nothing of it sent) only once it is stale, quietly."""
        with self._cond:
            old = [
                s for s in self._pending if s < step and s in self._waits and (s in self._announced or self._stale(s))
            ]
            gone = [(s, self._pending.pop(s), s not in self._announced) for s in sorted(old)]
            for s, _, _ in gone:
                self._waits.pop(s, None)
                self._quiet_at.pop(s, None)
                self._unpicked.discard(s)
                self._announced.discard(s)
            self._cond.notify_all()
        for s, where, unpicked in gone:
            why = f"superseded: step {step} is durable, and the other nodes' parts of this one did not come"
            self._report(Outcome(s, str(where), False, 0, 0.0, error=why, skipped=unpicked))

    def _stale(self, step: int) -> bool:
        """Older than the two newest steps made durable: a step another node's retention may sweep
        (`durable.keeper`), so a node that has sent nothing of it yet sends nothing (under the lock)."""
        return step < (sorted(self._durable)[-2:-1] or [-1])[0]

    def _report(self, outcome: Outcome) -> None:
        self._call(self.on_outcome, outcome)

    @staticmethod
    def _call(hook: Callable[..., None] | None, *args: object) -> None:
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:  # noqa: BLE001 - a reporter that fails must not stop every later upload
            pass

    def _upload(self, step: int, path: Path, picked: bool = True) -> Outcome | None:
        """Upload until it goes through or cannot; None when closed meanwhile. Raises _Preempted, and _Waiting.
        In a node-local job it goes only where the tier's `follows` says so (`on_started` once it does)."""
        started = self.clock()
        delay = self.backoff_initial_s
        attempts = 0
        while True:
            attempts += 1
            try_started = self.clock()
            leader = True  # a wait raised now is for the leader's pick
            try:
                if self.node is None:
                    verdict = "go" if picked else "skip"
                else:
                    verdict = self.tier.follows(path, self.node, picked)
                with self._cond:
                    stale = verdict == "follow" and self._stale(step)
                if verdict == "skip" or stale:
                    return Outcome(step, str(path), False, attempts, self.clock() - started, skipped=True)
                with self._cond:
                    announce = step not in self._announced
                    self._announced.add(step)
                    self._quiet_at.pop(step, None)
                if announce:
                    self._call(self.on_started, step, str(path))
                leader = False
                hold, held = self._hold_for(step, path)
                # Passed only where there is a hold: a tier written before pause hooks takes on_part and node only.
                held_by: dict[str, Any] = {} if self.node is None else {"node": self.node}
                if hold is not None:
                    held_by["pause"] = functools.partial(hold.wait, give_up=self._giving_up)
                report = self.tier.upload(path, on_part=self._check_closing, **held_by)
            except (_Stopped, _Preempted) as e:
                if isinstance(e, _Preempted):
                    raise
                return None
            except DurableWaitError as e:
                raise _Waiting(str(e), leader) from None
            except DurableTierError as e:  # the tier failed: the same upload is tried again, resuming
                with self._cond:
                    self._last_error = str(e)
                self._call(self.on_retry, step, str(e), delay)
                with self._cond:
                    if self._cond.wait_for(lambda: self._closing or self._preempt, timeout=delay):
                        if self._closing:
                            return None
                        raise _Preempted() from None
                delay = min(delay * 2, self.backoff_max_s)
                continue
            except (CheckpointError, OSError) as e:  # this checkpoint cannot go: reported, dropped
                return Outcome(step, str(path), False, attempts, self.clock() - started, error=str(e))
            except Exception as e:  # noqa: BLE001 - adapter boundary: a bug on a hostile answer drops this one only
                why = f"{type(e).__name__}: {e}"
                return Outcome(step, str(path), False, attempts, self.clock() - started, error=why)
            with self._cond:
                self._last_error = None
            waited = 0.0 if hold is None else hold.held_s - held
            sent = self.clock() - try_started - waited
            return Outcome(
                step, str(path), True, attempts, self.clock() - started, report=report, send_s=sent, held_s=waited
            )

    def _hold_for(self, step: int, path: Path) -> tuple[SaveHold | None, float]:
        """The hold of the fast tier `path` lives in, and the seconds it held so far; (None, 0) for an urgent
        checkpoint, or with no hold configured."""
        with self._cond:
            if self.hold_s <= 0 or step in self._urgent:
                return None, 0.0
            hold = self._holds.get(path.parent)
            if hold is None:
                hold = self._holds[path.parent] = SaveHold(path.parent, max_hold_s=self.hold_s, clock=self.clock)
        return hold, hold.held_s

    def _giving_up(self) -> bool:
        return self._closing or self._preempt

    def _check_closing(self, rel: str, number: int) -> None:
        if self._closing:
            raise _Stopped()
        if self._preempt:
            raise _Preempted()
