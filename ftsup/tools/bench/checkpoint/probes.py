"""Process-level measurements a rank takes of itself: RSS, I/O counters, page cache, stalls.

Linux-only readers of /proc; each returns None (never a made-up figure) when the kernel
refuses, so a report can say "unknown" instead of a wrong number.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _status_kib(name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def current_rss() -> int | None:
    return _status_kib("VmRSS")


def peak_rss() -> int | None:
    """VmHWM: the resident high-water mark since the last `reset_peak_rss()`."""
    return _status_kib("VmHWM")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so a peak belongs to one row."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> bool:
    """Return freed heap memory to the kernel (glibc malloc_trim), so RSS shows live memory.

    Freed tensors below glibc's mmap threshold stay in the heap and keep counting as RSS; a
    row's peak would otherwise include whatever the previous row left behind.
    """
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds the threads process `pid` has now have run, to the nanosecond (each thread's
    /proc/PID/task/TID/schedstat; /proc/PID/stat counts in clock ticks of 10 ms); a thread that ended is
    not counted, so a difference of two readings covers the threads alive at both. None when unreadable."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def io_counters() -> dict[str, int]:
    """/proc/self/io (whole process, all threads); empty when unreadable."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key.strip()] = int(value)
    except OSError:
        pass
    return out


def io_delta(before: dict[str, int], after: dict[str, int], key: str) -> int | None:
    if key in before and key in after:
        return after[key] - before[key]
    return None


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the clean page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


class Waiter:
    """Runs `wait` (a save handle's or future's blocking wait) in a thread, timing its end.

    One uniform way to learn when a background save became durable, whatever object the
    checkpointer returned, without polling it from the training loop.
    """

    def __init__(self, wait: Callable[[], Any], start: float) -> None:
        self._start = start
        self._done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.end: float | None = None
        self._thread = threading.Thread(target=self._run, args=(wait,), daemon=True)
        self._thread.start()

    def _run(self, wait: Callable[[], Any]) -> None:
        try:
            self.result = wait()
        except BaseException as exc:  # handed to the owner, who re-raises it
            self.error = exc
        finally:
            self.end = time.perf_counter()
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout: float | None = None) -> float:
        """Seconds from `start` to completion; re-raises the wait's exception."""
        self._thread.join(timeout)
        if not self._done.is_set():
            raise TimeoutError("background save did not finish in time")
        if self.error is not None:
            raise self.error
        return (self.end if self.end is not None else self._start) - self._start


@dataclass
class StepLog:
    """Step durations around one background save on this rank.

    `before` and `after` are steps with nothing in flight, timed just before the save call and
    just after every rank's save finished; `during` are the steps this rank ran while its own
    save was in flight. The extra time is a sum of step times, so it is compared with the
    mean of the unloaded steps, not their median: step times here are skewed to the right,
    and a median baseline would count part of every step's ordinary noise as the save's.
    Steps on both sides cancel a drift in the machine's speed over the save.
    """

    before: list[float]
    during: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)

    @property
    def baseline_s(self) -> float:
        unloaded = self.before + self.after
        return sum(unloaded) / len(unloaded)

    @property
    def extra_s(self) -> float:
        """Time lost to the save: sum of in-flight steps minus as many baseline steps."""
        return max(0.0, sum(self.during) - self.baseline_s * len(self.during))
