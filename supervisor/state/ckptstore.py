"""The checkpoint store as the daemon sees it, read on a thread of its own so that a slow or hostile store never
stalls the loop: periodic scans and the resume choice (docs/design/state.md, The store scanner).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftsup.store import choice, durable, layout, tiers
from ftsup.store.errors import CheckpointError, ManifestError
from ftsup.supervisor.state import memview

REFRESH_S = 2.0
DURABLE_TIMEOUT_S = 30.0
"""How long the resume choice waits for the durable tier's part (a listing, then a check of each checkpoint newer
than the fast tier's choice) before it goes on with the fast tier's choice alone."""
CHILD_CHECK_BYTES = 4 << 20
"""Manifests this big (about 19,000 ranks: the commit writes those compact) or bigger are checked in a child process."""
CHILD_TIMEOUT_S = 120.0
_CHILD = (
    "import json, sys\n"
    "from ftsup.store import layout\n"
    "i = layout.inspect_checkpoint(sys.argv[1])\n"
    "print(json.dumps(dict(i.to_json(), tensor_bytes=i.tensor_bytes)))\n"
)


@dataclass(frozen=True)
class StoreView:
    """The store as last scanned; `scans` and `errors` count attempts (a failed scan keeps the
    previous `latest` and `committed`)."""

    latest: layout.CheckpointInfo | None = None
    committed: int = 0
    scans: int = 0
    errors: int = 0
    last_error: str | None = None
    last_exception: Exception | None = None  # what `last_error` describes
    recent: tuple[layout.CheckpointInfo, ...] = ()
    """The newest `recent` committed checkpoints, each fast-checked, newest first (for the durable tier)."""
    missing: bool = False
    """The directory was not there (or something else was in its place) at the last scan that went through."""
    memory: dict[str, Any] | None = None
    """The node's memory tier as the last scan read it (`memview.read`); None without one."""


@dataclass(frozen=True)
class Resume:
    """The resume choice and the chosen checkpoint's manifest metadata; `answered` is False when
    the store gave no answer in time (or the choice failed): then the ranks' own load picks."""

    picked: choice.Choice
    metadata: dict[str, Any] = field(default_factory=dict)
    answered: bool = True
    error: str | None = None
    abandoned: tuple[choice.Passed, ...] = ()  # checkpoints after a rollback's choice, renamed (or not: SKIPPED)
    tier: str | None = None
    """Where the chosen checkpoint is: `tiers.FAST`, `tiers.DURABLE` (the ranks read it from the durable tier), or
    None (none chosen)."""
    durable_error: str | None = None
    """Why the durable tier had no part in the choice (it failed, or gave no answer in time), when one is set."""

    @property
    def quiet(self) -> bool:
        """Nothing worth a warning: an answer, and nothing passed over."""
        return self.answered and not self.picked.passed

    @property
    def why_no_checkpoint(self) -> str:
        if not self.answered:
            return f"the checkpoint directory gave no answer ({self.error}); the ranks choose when they load"
        return "no usable checkpoint: fresh start" if self.picked.passed else "no checkpoint: fresh start"


class _Request:
    def __init__(self, at_most: int | None, tag: int) -> None:
        self.at_most = at_most
        self.tag = tag  # the caller's, handed back with a late result
        self.done = threading.Event()
        self.result: Resume | None = None
        self.error: OSError | CheckpointError | None = None  # the store could not be read: the caller's to retry
        self.given_up = False  # the caller stopped waiting: its result, made later, goes to `take_late()`


class StoreScanner:
    def __init__(
        self, root: str | os.PathLike[str], *, deep: bool = False, interval_s: float = REFRESH_S, recent: int = 0
    ) -> None:
        self._root = Path(root)
        self._deep = deep
        self._recent = recent  # how many of the newest checkpoints a scan checks and reports, beyond the latest
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._view = StoreView()
        self._requests: list[_Request] = []
        self._late: list[tuple[int, Resume]] = []  # (tag, choice) made after its caller gave up on it
        self._cache: dict[str, tuple[tuple[Any, ...], layout.CheckpointInfo]] = {}
        self._thread = threading.Thread(target=self._run, name="ftsup-ckpt-scan", daemon=True)

    _durable: Callable[[], durable.DurableTier] | None = None  # set by `with_durable_tier`
    _durable_timeout_s = DURABLE_TIMEOUT_S
    _durable_only = False
    _memory: tuple[Path, int, int] | None = None

    def with_durable_tier(
        self,
        opener: Callable[[], durable.DurableTier] | None,
        timeout_s: float = DURABLE_TIMEOUT_S,
        *,
        durable_only: bool = False,
    ) -> StoreScanner:
        """Make the resume choice across the fast tier and the durable tier `opener` opens (None: none), the tier's
        part waited for at most `timeout_s` (docs/design/state.md, The store scanner); before `start()`.
        `durable_only` (the nodes of the job keep separate fast tiers): the newest checkpoint committed in the durable
        tier, since a local one cannot be known complete on the other nodes; the fast tier's choice only when the
        tier fails."""
        self._durable, self._durable_timeout_s, self._durable_only = opener, timeout_s, durable_only
        return self

    def with_memory_tier(self, where: Path, replicas: int, keep_last: int) -> StoreScanner:
        """Read the node's memory tier `where` at each scan too (`StoreView.memory`); before `start()`."""
        self._memory = (where, replicas, keep_last)
        return self

    def start(self) -> StoreScanner:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread. One stuck in the filesystem (a hung network mount) cannot be joined:
        it is a daemon thread, left to the process's exit, and holds nothing the daemon needs."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def view(self) -> StoreView:
        with self._lock:
            return self._view

    def choose(self, timeout_s: float, at_most: int | None = None, tag: int = 0) -> Resume:
        """The resume choice (of a step at most `at_most`, abandoning the ones after it), made now on the scanner's
        thread (on the caller's before `start()`).

        Raises the OSError or CheckpointError that made the store unreadable (an outage: the caller
        retries; the resume point must come from the store, not from its absence). Not `answered`
        if it failed otherwise (counted in the view's errors) or took longer than `timeout_s` (it is
        still made, and the next scan sees its outcome)."""
        req = _Request(at_most, tag)
        if not self._thread.is_alive():
            self._serve(req)
            timeout_s = 0.0
        with self._lock:
            self._requests.append(req)
        self._wake.set()
        req.done.wait(timeout_s)
        with self._lock:
            req.given_up = not req.done.is_set()
        if req.error is not None:
            raise req.error
        if req.result is not None:
            return req.result
        error = self.view().last_error if not req.given_up else f"nothing within {timeout_s:g}s"
        return Resume(choice.Choice(None), answered=False, error=error)

    def take_late(self) -> list[tuple[int, Resume]]:
        """The choices made since the last call whose callers had stopped waiting for them (`choose`'s timeout),
        each with its `choose` call's `tag`: what they quarantined, skipped or abandoned is still to be told."""
        with self._lock:
            late, self._late = self._late, []
        return late

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.is_set():
            self._serve_requests()
            if self._stop.is_set():
                return
            self.scan()
            self._wake.wait(self._interval_s)
            self._wake.clear()

    def _serve_requests(self) -> None:
        while True:
            with self._lock:
                if not self._requests:
                    return
                req = self._requests.pop(0)
            self._serve(req)

    def _serve(self, req: _Request) -> None:
        result: Resume | None = None
        error: OSError | CheckpointError | None = None
        try:
            result = self._choose(req.at_most)
        except (OSError, CheckpointError) as e:
            error = e
            self._count_error(e)
        except Exception as e:  # adapter boundary: a bug on hostile input is counted, the ranks choose
            self._count_error(e)
        with self._lock:  # the caller takes the result, or has given up and `take_late()` hands it on
            if req.given_up:
                if result is not None:
                    self._late.append((req.tag, result))
            else:
                req.result, req.error = result, error
            req.done.set()

    def scan(self) -> None:
        """One scan, on the caller's thread (the scanner's own, or a test's before `start()`)."""
        try:
            self._scan()
        except Exception as e:  # adapter boundary: a store error is counted and retried, never fatal
            self._count_error(e)

    def _count_error(self, e: Exception) -> None:
        with self._lock:
            v = self._view
            self._view = StoreView(
                v.latest, v.committed, v.scans + 1, v.errors + 1, f"{type(e).__name__}: {e}", e, v.recent
            )

    def _choose(self, at_most: int | None) -> Resume:
        fast = choice.choose(self._root, deep=self._deep, at_most=at_most)
        only = self._durable_only and self._durable is not None
        both, durable_error = self._across(choice.Choice(None) if only else fast, at_most)
        if only and durable_error is not None:  # the tier failed: the ranks' own load falls back the same way
            both = tiers.from_fast(fast)
        picked = both.as_choice
        abandoned: tuple[choice.Passed, ...] = ()
        if at_most is not None:
            after = picked.info.step if picked.info is not None else -1
            abandoned = choice.abandon(self._root, after, f"a rollback to step {at_most} or before chose step {after}")
        self._cache.clear()  # it may have renamed some
        meta: dict[str, Any] = {}
        if both.durable is not None:
            meta = dict(both.durable.manifest.metadata)
        elif picked.info is not None and picked.info.metadata is not None:
            meta = dict(picked.info.metadata)  # as its check read it: a 50,000-file manifest is not parsed twice
        elif picked.info is not None:
            try:
                meta = dict(layout.read_manifest(picked.info.path).metadata)
            except ManifestError:
                pass  # it changed since the check: the ranks' own load decides
        return Resume(picked, meta, abandoned=abandoned, tier=both.tier, durable_error=durable_error)

    def _across(self, fast: choice.Choice, at_most: int | None) -> tuple[tiers.TierChoice, str | None]:
        """The choice across both tiers, or the fast tier's alone with the reason when the durable tier fails or
        does not answer within `durable_timeout_s` (its thread is left to finish, which its requests do by that
        deadline too: a daemon thread holding nothing the daemon needs; its answer is dropped)."""
        opener = self._durable
        if opener is None:
            return tiers.from_fast(fast), None
        done = threading.Event()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                with opener() as tier, tier.deadline(self._durable_timeout_s):  # then the thread ends too
                    box["choice"] = tiers.across(fast, tier, at_most=at_most, deep=self._deep)
            except Exception as e:  # adapter boundary: the tier (store down, no boto3, a bug on its answers)
                box["error"] = f"{type(e).__name__}: {e}"
            done.set()

        threading.Thread(target=work, name="ftsup-durable-choice", daemon=True).start()
        if not done.wait(self._durable_timeout_s):
            return tiers.from_fast(fast), f"no answer within {self._durable_timeout_s:g}s"
        if "choice" in box:
            return box["choice"], None
        return tiers.from_fast(fast), str(box.get("error"))

    def _scan(self) -> None:
        missing = not _is_directory(self._root)
        dirs = layout.committed_dirs(self._root)
        latest = None
        recent: list[layout.CheckpointInfo] = []
        for n, (_, path) in enumerate(reversed(dirs)):
            if latest is not None and n >= self._recent:
                break
            with self._lock:
                if self._requests or self._stop.is_set():
                    return  # the choice goes first; this scan is redone after it
            info = self._inspect(path)
            if n < self._recent:
                recent.append(info)
            if info.consistent and latest is None:
                latest = info
        memory = memview.read(*self._memory) if self._memory is not None else None
        names = {p.name for _, p in dirs}
        for name in [n for n in self._cache if n not in names]:
            del self._cache[name]
        with self._lock:
            v = self._view
            self._view = StoreView(
                latest, len(dirs), v.scans + 1, v.errors, v.last_error, v.last_exception, tuple(recent), missing, memory
            )

    def _inspect(self, path: Path) -> layout.CheckpointInfo:
        key = _fingerprint(path)
        cached = self._cache.get(path.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        big = len(key) > 3 and key[3] >= CHILD_CHECK_BYTES
        # Fast checks only: `deep` is for the resume choice.
        info = _inspect_in_child(path) if big else layout.inspect_checkpoint(path)
        self._cache[path.name] = (key, info)
        return info


def _inspect_in_child(path: Path) -> layout.CheckpointInfo:
    """`layout.inspect_checkpoint(path)`, run by a fresh interpreter (no preexec_fn: safe beside
    the daemon's threads); a child that fails makes the checkpoint one that could not be checked."""
    try:  # the same interpreter and environment import the same ftsup
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
        j = json.loads(done.stdout)
        unknown = bool(j["unknown_format"])
        problems = tuple(layout.Problem(None, str(p), unknown_format=unknown) for p in j["problems"])
        return layout.CheckpointInfo(
            step=int(j["step"]),
            path=str(path),
            consistent=bool(j["consistent"]),
            kind=j["kind"],
            world_size=j["world_size"],
            created_unix=j["created_unix"],
            problems=problems,
            tensor_bytes=j["tensor_bytes"],
        )
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as e:
        step = layout.parse_step_dirname(path.name)
        why = f"could not be checked in a child process ({type(e).__name__}: {e})"
        return layout.CheckpointInfo(
            step=-1 if step is None else step,
            path=str(path),
            consistent=False,
            problems=(layout.Problem(layout.MANIFEST_NAME, why),),
        )


def _is_directory(path: Path) -> bool:
    """Whether `path` is a directory (through a link, as the ranks open it); an error but its absence is raised."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _fingerprint(path: Path) -> tuple[Any, ...]:
    d = os.lstat(path)
    try:
        m = os.lstat(path / layout.MANIFEST_NAME)
        manifest: tuple[Any, ...] = (m.st_ino, m.st_size, m.st_mtime_ns, m.st_ctime_ns)
    except OSError as e:
        manifest = (e.errno,)
    return (d.st_ino, d.st_mtime_ns, *manifest)
