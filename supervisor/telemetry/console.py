"""The supervisor's log events as a person at a terminal reads them: a short line per change of state.

`line(event)` is the text `ftsup run` shows on stderr for one event, or None; the JSON lines stay the record
(docs/design/telemetry.md, The console).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONSOLE_LINES = 8  # of a rank's output, under a failure

_FAILURES = frozenset({"worker_exited", "heartbeat_timed_out", "progress_timed_out", "startup_timed_out"})
_ENDS = frozenset({"crash_loop_detected", "restart_budget_exhausted", "job_failed"})


def line(ev: Mapping[str, Any]) -> str | None:
    """The console's text for the log event `ev` (its fields as logged), or None."""
    name = ev.get("event")
    if name in _FAILURES:
        return _failure(f"attempt {ev.get('attempt')} failed: {ev.get('reason')}", ev)
    if name in _ENDS:
        return _failure(f"giving up: {ev.get('reason')}", ev, output=name == "job_failed")
    render = _LINES.get(str(name))
    if render is not None:
        return "ftsup: " + render(ev)
    if ev.get("level") in ("warning", "error"):
        reason = ev.get("reason")
        return f"ftsup: {ev.get('level')}: {name}" + (f": {reason}" if reason else "")
    return None


def _failure(head: str, ev: Mapping[str, Any], *, output: bool = True) -> str:
    lines = [f"ftsup: {head}"]
    shown = ev.get("output")
    if output and isinstance(shown, list) and shown:
        who = f"rank {ev['rank']}" if ev.get("rank") is not None else "torchrun"
        lines.append(f"  last lines of {who}'s output:")
        lines.extend(f"    | {text}" for text in shown[-CONSOLE_LINES:])
    if ev.get("log"):
        lines.append(f"  log: {ev['log']}")
    return "\n".join(lines)


def _launched(ev: Mapping[str, Any]) -> str:
    step = ev.get("resume_step")
    start = "from scratch" if step is None else f"resuming from step {step}"
    return f"attempt {ev.get('attempt')} launched: {ev.get('world_size')} rank(s), {start}" + (
        f"; output in {ev['log']}" if ev.get("log") else ""
    )


def _lost(ev: Mapping[str, Any]) -> str:
    steps = ev.get("lost_steps")
    first, last = steps if isinstance(steps, list) and len(steps) == 2 else ("?", "?")
    lost = f"steps {first}-{last}, which earlier attempts reported, are lost and trained again"
    if ev.get("step") == 0:
        return (
            f"warning: attempt {ev.get('attempt')} started from scratch: {lost}. To resume instead, adopt a Session "
            "(docs/adopting.md) or save and resume in the script"
        )
    return f"attempt {ev.get('attempt')} resumed at step {ev.get('step')}: {lost}"


def _finished(ev: Mapping[str, Any]) -> str:
    step = ev.get("step")
    reached = f"step {step}" if isinstance(step, int) and step >= 0 else "no step reported"
    return f"training finished: attempt {ev.get('attempt')}, {reached}"


def _detection(ev: Mapping[str, Any]) -> str:
    """Whether the ranks are instrumented, and so from when hangs are detected (docs/supervising.md)."""
    instrumented, mode = ev.get("instrument"), ev.get("heartbeat_mode")
    if instrumented is None:
        return ""
    ranks = "ranks auto-instrumented" if instrumented else "ranks not instrumented (--no-instrument)"
    if mode == "off":
        return f"\nftsup: {ranks}; hang detection off (heartbeat.mode: off): crashes only"
    if mode == "required":
        return f"\nftsup: {ranks}; hangs detected from launch on (heartbeat.mode: required)"
    if instrumented:
        return f"\nftsup: {ranks}: hangs detected from each attempt's first optimizer step"
    return f"\nftsup: {ranks}: hang detection off until the script sends heartbeats itself; crashes only"


def _seconds(ev: Mapping[str, Any]) -> str:
    d = ev.get("duration_s")
    return f"{d:.1f} s" if isinstance(d, (int, float)) else "?"


_LINES = {
    "supervisor_started": lambda ev: (
        f"supervising {ev.get('run_id')} on node {ev.get('node_id')}"
        + (f"; metrics on http://{ev['metrics']}/metrics" if ev.get("metrics") else "")
        + _detection(ev)
    ),
    "workers_launched": _launched,
    "first_step_reached": lambda ev: (
        f"attempt {ev.get('attempt')} reached its first step, {ev.get('step')}, {_seconds(ev)} after launch"
    ),
    "checkpoint_found": lambda ev: f"checkpoint of step {ev.get('step')} committed ({ev.get('kind') or '?'})",
    "checkpoint_committed": lambda ev: (
        f"{ev.get('kind') or ''} checkpoint of step {ev.get('step')} committed".lstrip()
        + (" in the fallback directory (checkpoint.dir refused it)" if ev.get("fallback") else "")
    ),
    "emergency_save_failed": lambda ev: f"{ev.get('level')}: {ev.get('reason')}",
    "checkpoint_dir_recreated": lambda ev: f"warning: {ev.get('reason')} (at step {ev.get('step')})",
    "durable_committed": lambda ev: f"checkpoint of step {ev.get('step')} durable in {ev.get('url')}",
    "durable_deadline_missed": lambda ev: f"warning: {ev.get('reason')}",
    "restart_scheduled": lambda ev: f"relaunching in {_seconds(ev)}",
    "job_succeeded": _finished,
    "progress_lost": _lost,
    "job_stopped": lambda ev: f"stopped: {ev.get('reason')}",
    "stop_requested": lambda ev: f"stopping the workers: {ev.get('reason')}",
    "eviction_noticed": lambda ev: f"eviction notice: {ev.get('reason')}",
    "save_requested": lambda ev: f"asked the ranks for an emergency save ({ev.get('reason')})",
    "supervisor_exited": lambda ev: f"exit status {ev.get('code')}",
    "straggler_detected": lambda ev: (
        f"rank {ev.get('rank')} is a straggler: {ev.get('ratio')} x the other ranks' step time for {ev.get('steps')} "
        "steps (reported, not stopped)"
    ),
    "throughput_drift_detected": lambda ev: (
        f"step time drifted up: {ev.get('ratio')} x the job's first window ({ev.get('median_s')} s per step)"
    ),
    "data_skipped": lambda ev: f"data skipped from now on: {ev.get('samples')} positions more, {ev.get('skips')}",
}
