"""What both peers of `ftsup bench recovery` share: where faults are aimed, and how measured
faults become a result row (medians over the repeats)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from typing import Any

from ftsup.store import layout
from ftsup.tools.faults import chaos
from ftsup.tools.faults.refjob import TrainerJob

SPLIT_KEYS = ("detection_s", "teardown_s", "backoff_s", "launch_s", "load_s")
SAMPLE_KEYS = ("detect_s", "recover_s", "lost_steps", "resume_step", "detected_by")
STEP_GAP = 3  # steps a relaunched attempt logs past the previous best before the next fault


def aim(at_least: int, ckpt_every: int) -> int:
    """The first step from `at_least` (and from 10, so that step times are known) that is 3 steps
    past a checkpoint: every fault then costs about the same redone steps, for either peer."""
    step = max(at_least, 10)
    while step % ckpt_every != 3 % ckpt_every:
        step += 1
    return step


def wait_aimed(
    job: TrainerJob, tail: chaos.LossLogTail, step: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Wait until `step` is logged and the checkpoint before it has committed (its commit is
    asynchronous and, under load, can take longer than 3 steps; without this, lost_steps would
    measure that race rather than the launcher). Returns early when `proc` exits."""
    ckpt = step - step % job.ckpt_every

    def ready() -> bool:
        if proc is not None and proc.poll() is not None:
            return True
        latest = layout.latest_consistent(job.ckpt_dir)
        return tail.max_step() >= step and latest is not None and latest.step >= ckpt

    chaos.poll_until(ready, timeout_s, f"step {step} logged and checkpoint {ckpt} committed", interval_s=0.02)


def row(name: str, kind: str, measured: Sequence[dict[str, Any]], note: str | None = None) -> dict[str, Any]:
    """One result row: medians over `measured` (each a `refjob.fault_timeline`-shaped dict).
    recover_s is null when any repeat did not recover, and the note says how many."""
    split = {}
    for k in SPLIT_KEYS:
        if any(k in (f.get("split") or {}) for f in measured):
            split[k] = rounded(chaos.median([(f.get("split") or {}).get(k) for f in measured]))
    missing = sum(1 for f in measured if f.get("recover_s") is None)
    if missing and note is None:
        note = f"{missing} of {len(measured)} faults not recovered"
    return {
        "name": name,
        "fault": kind,
        "detect_s": rounded(chaos.median([f.get("detect_s") for f in measured])),
        "recover_s": None if missing else rounded(chaos.median([f.get("recover_s") for f in measured])),
        "lost_steps": rounded(chaos.median([f.get("lost_steps") for f in measured])),
        "orphans": None,
        "split": split,
        "repeats": len(measured),
        "samples": [{k: f[k] for k in SAMPLE_KEYS if k in f} for f in measured],
        "note": note,
    }


def step_times(tail: chaos.LossLogTail, launches: Sequence[float], before: float) -> list[float]:
    """Gaps between consecutive steps of one attempt (a launch in between splits attempts)."""
    gaps = []
    lines = [ln for ln in tail.lines() if ln.t <= before]
    for a, b in zip(lines, lines[1:], strict=False):
        same_attempt = not any(a.t < t_launch < b.t for t_launch in launches)
        if same_attempt and b.step == a.step + 1:
            gaps.append(b.t - a.t)
    return gaps


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
