"""The policy's rules that need no state machine: timeouts, which detections apply, progress, world size, backoff,
whether an emergency save fits. Pure functions; no I/O, no clock (docs/design/policy.md, The rules).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ftsup.supervisor.config.job import HeartbeatMode
from ftsup.supervisor.policy.events import Settings


def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def heartbeat_timeout(s: Settings, step_times: Sequence[float]) -> float | None:
    """Seconds of silence that mean a hang in `train`; None until steps have been seen."""
    if s.heartbeat_timeout_s is not None:
        return s.heartbeat_timeout_s
    q = p99(step_times)
    return None if q is None else max(s.min_timeout_s, s.step_time_multiplier * q)


def progress_timeout(s: Settings, step_times: Sequence[float]) -> float | None:
    if s.progress_timeout_s is not None:
        return s.progress_timeout_s
    hb = heartbeat_timeout(s, step_times)
    return None if hb is None else 2 * hb


def hang_detection_on(s: Settings, beating: bool) -> bool:
    """Whether silence, stalls and a slow start fail an attempt: `heartbeat.mode` required, or auto once the job
    has sent a heartbeat (`beating`)."""
    return s.heartbeat_mode == HeartbeatMode.REQUIRED or (s.heartbeat_mode == HeartbeatMode.AUTO and beating)


def made_progress(
    s: Settings, *, max_step: int, best_before: int, resume_step: int | None, detecting: bool, ran_s: float
) -> bool:
    """Whether an attempt that ended moved the job on: it reached a step no earlier attempt reached (a job that
    dies at the same step every time, with or without checkpoints, is a crash loop however often it restarts);
    or, when it sent no training step and no hang detection applied, it ran past `startup_timeout_s`."""
    if max_step >= 0 or detecting:
        return max_step > max(best_before, resume_step if resume_step is not None else 0)
    return ran_s >= s.startup_timeout_s


def choose_world_size(s: Settings, healthy_slots: int, batch_divisor: int | None) -> tuple[int | None, str]:
    """Local ranks for the next attempt: healthy slots, at most nproc_max, such that the job's
    world size stays within [min, max] and divides the batch. (None, why) when impossible."""
    n = min(healthy_slots, s.nproc_max)
    if s.max_world_size is not None:
        n = min(n, s.max_world_size)
    while n >= 1:
        if batch_divisor is None or batch_divisor % n == 0 or s.nnodes_max > 1:
            break
        n -= 1
    if n < 1 or (s.nnodes_max == 1 and n < s.min_world_size):
        return None, (
            f"{healthy_slots} healthy slot(s) allow no world size >= min_world_size {s.min_world_size}"
            + (f" that divides {batch_divisor}" if batch_divisor else "")
        )
    return n, f"{healthy_slots} healthy slot(s) -> {n} rank(s)"


def backoff_s(s: Settings, failures_in_a_row: int) -> float:
    """The wait before a restart. A failure after progress (the first in a row) restarts at once, as torchrun
    restarts its workers: a job failing once an hour loses no time to waiting. Failures in a row (attempts
    that reached no new step) wait `backoff_initial_s`, doubling each time up to `backoff_max_s`."""
    if failures_in_a_row <= 1:
        return 0.0
    return min(s.backoff_max_s, s.backoff_initial_s * 2 ** (failures_in_a_row - 2))


def save_estimate_s(s: Settings, save_times: Sequence[float], state_bytes: int | None) -> float | None:
    """How long a blocking save takes: the slowest of the recent measured ones, else a guess from
    the checkpoint's size, else unknown."""
    if save_times:
        return max(save_times[-5:])
    if state_bytes:
        return state_bytes / s.assumed_save_bytes_per_s
    return None


def save_fits(
    s: Settings,
    step_times: Sequence[float],
    save_times: Sequence[float],
    now: float,
    deadline: float,
    state_bytes: int | None,
    upload_s: float | None = None,
) -> tuple[bool, str]:
    """Whether an emergency save (a step, the save with half of it again, the margin) fits before `deadline`.

    With a durable tier (`upload_s`: the upload's expected time at the measured throughput) the save is done when
    it is durable, so the upload counts too. A local save that fits while its upload would not is still made
    (the fast tier's copy serves a restart on this machine, and the upload goes on until the deadline); the reason
    says that it is not expected to be durable in time."""
    step_s = p99(step_times) or 0.0
    est = save_estimate_s(s, save_times, state_bytes)
    local = step_s + 1.5 * (est or 0.0) + s.save_margin_s
    need = local + (upload_s or 0.0)
    left = deadline - now
    basis = f"save ~{est:.2f}s" if est is not None else "no save measured yet"
    if upload_s is not None:
        basis += f", upload ~{upload_s:.2f}s"
    why = f"needs {need:.1f}s ({basis}, step {step_s:.2f}s, margin {s.save_margin_s:g}s), {left:.1f}s left"
    if need > left and local <= left:
        why += "; the save alone fits, not its upload: it is not expected to be durable before the deadline"
    return local <= left, why
