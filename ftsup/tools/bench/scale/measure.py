"""The clock of `ftsup bench scale`: an operation's times over repeats and its peak of resident memory.

Torch-free: the benchmark's process of a world size (`scale_child`) and its store-side process
(`ftsup.tools.bench.scale.store`) measure with it alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any


def measure(fn: Callable[[], Any], repeats: int, *, budget_s: float = 20.0, warmup: bool = False) -> dict[str, Any]:
    """Run `fn` `repeats` times, or fewer once the runs have taken `budget_s` (at least once): its times (median,
    min, max, every run) and its peak resident memory (the highest of the runs; `peak_rss_increase_bytes` over
    the resident memory before the run). A run's time is what `fn` returns when that is a float (a simulated
    collective's critical path), or its wall time. `warmup`: one untimed run first. The objects there before a
    run are frozen out of the garbage collector's reach during it: one process holds what N processes would, and a
    collection scanning it all would be charged to the run."""
    if warmup:
        fn()
    runs: list[float] = []
    peak = increase = None
    spent = 0.0
    while len(runs) < max(1, repeats) and (not runs or spent < budget_s):
        gc.collect()
        gc.freeze()  # what exists now (the simulation's other ranks, earlier results) is not the run's to collect
        before = reset_peak_rss()
        t0 = time.perf_counter()
        try:
            value = fn()
        finally:
            wall = time.perf_counter() - t0
            gc.unfreeze()
        spent += wall
        runs.append(value if isinstance(value, float) else wall)
        high = peak_rss()
        if high is not None and before is not None:
            peak, increase = max(peak or 0, high), max(increase or 0, high - before)
    return {
        "median_s": statistics.median(runs),
        "min_s": min(runs),
        "max_s": max(runs),
        "runs_s": [round(r, 6) for r in runs],
        "peak_rss_bytes": peak,
        "peak_rss_increase_bytes": increase,
    }


def reset_peak_rss() -> int | None:
    """Reset this process's high-water mark of resident memory (Linux: `clear_refs` 5); its resident memory now,
    or None where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS")
    except OSError:
        return None


def peak_rss() -> int | None:
    """The high-water mark of resident memory since `reset_peak_rss` (bytes), or None."""
    try:
        return _status_kib("VmHWM")
    except OSError:
        return None


def _status_kib(key: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None
