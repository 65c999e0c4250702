"""ftsup's side of `ftsup bench recovery`: one supervised job that takes every fault. The kill and hang repeats come
first (they make the rows), then kills up to --cycles, SIGKILL of the supervisor itself and a new `ftsup run` that
adopts the journal and finishes the job, with an orphan count after each; the targets are checked on its logs.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftsup.tools.bench.recovery.common import STEP_GAP, aim, rounded, row, step_times, wait_aimed
from ftsup.tools.faults import chaos
from ftsup.tools.faults.refjob import (
    TrainerJob,
    child_env,
    fault_timeline,
    new_run_id,
    sigkill_supervisor_and_restart,
    start_supervisor,
    stop_supervisor,
    wait_exit,
    wait_resumed,
)

KILL_TARGET_S = 10.0
SAVE_DELAY_FLAG = "--save-delay-s"  # the trainer knob the slow-save check needs (see slow_save_check)


def bench_ftsup(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    faults = ["kill"] * args.repeats + ["hang"] * args.hang_repeats
    repeats = len(faults)  # the measured ones; kills after them only add fault cycles
    faults += ["kill"] * max(0, args.cycles - len(faults))
    steps = 12 + len(faults) * (STEP_GAP + 7) + 20
    # Heartbeat settings stay the defaults; only the restart budget is raised so that the
    # cycles themselves do not exhaust it (default: 10 restarts per hour).
    overrides = {"restart": {"max_restarts": len(faults) + 5}}
    job = TrainerJob(root, new_run_id("bench-ftsup"), steps, min_step_s=args.min_step_s, sections=overrides)
    job.write_config()
    print(f"ftsup: one job of {steps} steps, {len(faults)} fault cycles, then SIGKILL of the supervisor", flush=True)
    records: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    proc: subprocess.Popen[bytes] | None = start_supervisor(job, "1")
    try:
        with chaos.LossLogTail(job.loss_log) as tail:
            best = 0
            for i, kind in enumerate(faults):
                wait_aimed(job, tail, aim(best + STEP_GAP, job.ckpt_every), 180)
                ranks = chaos.wait_for_ranks(lambda: chaos.supervised_ranks(job.state_dir), job.nproc, 60)
                target = ranks[1] if kind == "kill" else ranks[0]
                t = chaos.send(target, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                line = wait_resumed(job, tail, t, 120)
                records.append({"fault": kind, "t": t, "cycle": i + 1, "repeat": i < repeats})
                best = tail.max_step()
                print(
                    f"  cycle {i + 1:>2}/{len(faults)} {kind:<4}: first resumed step {line.step} "
                    f"{line.t - t:.2f} s after the fault",
                    flush=True,
                )
            assert proc is not None
            supervisor_tree = {p.pid for p in chaos.tree([proc.pid])}
            left = chaos.matching_processes(job.markers, exclude=supervisor_tree)
            checks["orphans_after_cycles"] = _orphans(left, cycles=len(faults))
            wait_aimed(job, tail, aim(best + STEP_GAP, job.ckpt_every), 120)
            seen, proc = sigkill_supervisor_and_restart(job, proc, tail, 120)
            checks["orphans_after_supervisor_sigkill"] = {
                "processes_of_the_job": seen["processes_of_the_job"],
                "gone_s": seen["job_gone_s"],
                "orphans": len(seen["orphans"]),
                "processes": seen["orphans"],
                "pass": not seen["orphans"],
                "journal_adopted": seen["journal_adopted"],
                "restart_to_first_step_s": seen["restart_to_first_step_s"],
            }
            print(
                f"  SIGKILL of the supervisor: the job's {seen['processes_of_the_job']} processes gone after "
                f"{seen['job_gone_s']} s, {len(seen['orphans'])} orphan(s); a new `ftsup run` logged step "
                f"{seen['first_step']} {seen['recover_s']} s after the kill",
                flush=True,
            )
            codes = [-signal.SIGKILL, wait_exit(proc, 300, "the supervised job")]
            per_fault = [{**r, **fault_timeline(job, tail, r["t"])} for r in records]
    finally:
        stop_supervisor(proc, job)
    left = chaos.matching_processes(job.markers)
    chaos.stop_all(left)
    checks["orphans_after_run"] = _orphans(left)
    rows = []
    for kind in ("kill", "hang"):
        measured = [f for f in per_fault if f["fault"] == kind and f["repeat"]]  # the filler cycles are not
        if measured:
            rows.append({**row("ftsup", kind, measured), "orphans": len(left)})
    checks.update(_checks(job, tail, per_fault, codes, steps))
    orphan_checks = ("orphans_after_cycles", "orphans_after_supervisor_sigkill", "orphans_after_run")
    ok = (
        codes[-1] == 0
        and all(r["recover_s"] is not None for r in rows)
        and all(checks[k]["pass"] for k in orphan_checks)
    )
    return {"rows": rows, "checks": checks, "ok": ok, "tail": tail, "job": job}


def _orphans(left: Sequence[Any], **extra: Any) -> dict[str, Any]:
    return {**extra, "orphans": len(left), "processes": [chaos.describe(p) for p in left], "pass": not left}


def _checks(
    job: TrainerJob, tail: chaos.LossLogTail, per_fault: Sequence[dict[str, Any]], codes: Sequence[int], steps: int
) -> dict[str, Any]:
    events = chaos.read_events(job.supervisor_log)
    checks: dict[str, Any] = {}
    hangs = [f for f in per_fault if f["fault"] == "hang"]
    if hangs:
        # The target: a hang detected within max(3 x p99 step time, 2 s) + 1 s, with the p99 step
        # time this job showed before its first hang.
        gaps = step_times(tail, [e.t for e in events if e.event == "workers_launched"], hangs[0]["t"])
        q = chaos.p99(gaps)
        bound = None if q is None else max(3 * q, 2.0) + 1.0
        worst = max((f["detect_s"] for f in hangs if f.get("detect_s") is not None), default=None)
        checks["hang_detection"] = {
            "detect_s": worst,
            "p99_step_s": rounded(q),
            "bound_s": rounded(bound),
            "timeouts_s": [f.get("timeout_s") for f in hangs],
            "detected_by": [f.get("detected_by") for f in hangs],
            "pass": worst is not None and bound is not None and worst <= bound,
        }
    kills = [f.get("recover_s") for f in per_fault if f["fault"] == "kill"]
    med = chaos.median(kills)
    checks["kill_to_first_resumed_step"] = {
        "median_s": rounded(med),
        "target_s": KILL_TARGET_S,
        "faults": len(kills),
        "max_s": max((k for k in kills if k is not None), default=None),
        "pass": med is not None and None not in kills and med <= KILL_TARGET_S,
    }
    failures = [e for e in events if e.event in chaos.FAILURE_EVENTS]
    checks["no_unexpected_failure_events"] = {
        "failure_events": len(failures),
        "faults_injected": len(per_fault),
        "events": [f"{e.event}: {e.fields.get('reason')}" for e in failures][:50],
        "pass": len(failures) == len(per_fault),
    }
    got = chaos.last_line_per_step(job.loss_log)
    checks["job_completed"] = {
        "exit_codes": list(codes),
        "steps_logged": len(got),
        "steps": steps,
        "pass": codes[-1] == 0 and sorted(got) == list(range(1, steps + 1)),
    }
    return checks


def trainer_has_flag(flag: str) -> bool:
    """Whether the reference trainer accepts `flag` (asks its --help; that imports torch in a subprocess)."""
    argv = [sys.executable, "-m", "ftsup.trainer.examples.gpt", "--help"]
    done = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=120)
    return flag in done.stdout


def slow_save_check(root: Path, args: argparse.Namespace, ftsup: dict[str, Any]) -> dict[str, Any]:
    """A save 20 x longer than a step must raise no false alarm (default heartbeat settings).

    It needs a trainer that can block its loop in a save for a chosen time, inside
    `rt.phase("save")`: `--save-delay-s S`. Without that knob it says so and measures nothing."""
    tail: chaos.LossLogTail = ftsup["tail"]
    events = chaos.read_events(ftsup["job"].supervisor_log)
    gaps = step_times(tail, [e.t for e in events if e.event == "workers_launched"], time.time())
    step_s = chaos.median(gaps) or args.min_step_s
    if not trainer_has_flag(SAVE_DELAY_FLAG):
        return {
            "measured": False,
            "pass": None,
            "median_step_s": rounded(step_s),
            "note": f"the reference trainer has no {SAVE_DELAY_FLAG} knob (a periodic save that blocks the loop "
            "for that long, inside rt.phase('save')), so no save 20x longer than a step could be made; "
            "what was measured: no_unexpected_failure_events over the whole ftsup job",
        }
    delay = round(20 * step_s, 2)
    job = TrainerJob(
        root,
        new_run_id("bench-slow-save"),
        24,
        ckpt_every=10,
        min_step_s=args.min_step_s,
        extra_args=(SAVE_DELAY_FLAG, str(delay)),
    )
    job.write_config()
    print(f"slow save: {SAVE_DELAY_FLAG} {delay} (20 x the median step {step_s:.3f} s), default heartbeat", flush=True)
    proc = start_supervisor(job, "1")
    try:
        code = wait_exit(proc, 300, "the slow-save job")
    finally:
        stop_supervisor(proc, job)
    evs = chaos.read_events(job.supervisor_log)
    alarms = [f"{e.event}: {e.fields.get('reason')}" for e in evs if e.event in chaos.FAILURE_EVENTS]
    launches = sum(1 for e in evs if e.event == "workers_launched")
    return {
        "measured": True,
        "save_delay_s": delay,
        "median_step_s": rounded(step_s),
        "exit_code": code,
        "attempts": launches,
        "false_alarms": alarms,
        "pass": code == 0 and not alarms and launches == 1,
    }
