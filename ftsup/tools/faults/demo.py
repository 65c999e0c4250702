"""`ftsup demo`: the reference trainer under `ftsup run`, once uninterrupted and once with faults injected from
outside (SIGKILL of a rank, SIGSTOP of another, SIGKILL of the supervisor and a new `ftsup run`), then a report
and a bitwise comparison of the two loss logs. Exit 0 only when every fault was detected and recovered from, the
logs are equal and nothing is left running. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftsup.supervisor.errors import UsageError
from ftsup.tools.faults import chaos
from ftsup.tools.faults.refjob import (
    TrainerJob,
    fault_timeline,
    new_run_id,
    sigkill_supervisor_and_restart,
    start_supervisor,
    stop_supervisor,
    wait_exit,
    wait_resumed,
)

MIN_STEPS = 20
RUN_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- the demo


@dataclass(frozen=True)
class Fault:
    kind: str  # "kill-rank" | "stop-rank" | "kill-supervisor"
    at_step: int
    rank: int | None = None

    def label(self) -> str:
        if self.kind == "kill-rank":
            return f"SIGKILL rank {self.rank}"
        if self.kind == "stop-rank":
            return f"SIGSTOP rank {self.rank} (a hang)"
        return "SIGKILL the supervisor, then `ftsup run` again"


def fault_plan(steps: int, *, supervisor_kill: bool = True) -> list[Fault]:
    """Faults a little past a checkpoint (every 5 steps), so that each costs a step or two."""
    plan = [Fault("kill-rank", steps // 4 + 2, rank=1), Fault("stop-rank", steps // 2 + 2, rank=0)]
    if supervisor_kill:
        plan.append(Fault("kill-supervisor", 3 * steps // 4 + 2))
    return plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The description and flags of `ftsup demo`."""
    p.description = (
        "Run the reference trainer under `ftsup run` uninterrupted, then again while SIGKILLing a rank, SIGSTOPping "
        "a rank and SIGKILLing the supervisor; report detection and recovery and compare the loss logs bitwise. "
        "Exit 0 only when everything matched and nothing is left running."
    )
    p.add_argument("--dir", type=Path, metavar="DIR", help="work directory (default: a fresh temporary directory)")
    p.add_argument("--steps", type=int, default=60, help=f"training steps per run (at least {MIN_STEPS})")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as one JSON object to FILE")
    p.add_argument(
        "--no-supervisor-kill",
        dest="supervisor_kill",
        action="store_false",
        help="leave out the SIGKILL of the supervisor",
    )


def run(args: argparse.Namespace) -> int:
    if args.steps < MIN_STEPS:
        raise UsageError(f"--steps must be at least {MIN_STEPS} (three faults need room), got {args.steps}")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ftsup-demo-"))
    if root.exists() and any(root.iterdir()):
        raise UsageError(f"{root} is not empty; give --dir a new or empty directory")
    root.mkdir(parents=True, exist_ok=True)
    print(f"ftsup demo in {root}", flush=True)
    ref = TrainerJob(root / "uninterrupted", new_run_id("demo-ref"), args.steps)
    job = TrainerJob(root / "faults", new_run_id("demo-faults"), args.steps)
    result: dict[str, Any] = {"dir": str(root), "steps": args.steps, "world_size": ref.nproc, "error": None}
    try:
        result["reference"] = _run_reference(ref)
        plan = fault_plan(args.steps, supervisor_kill=args.supervisor_kill)
        result["faults"], result["exit_codes"] = _run_with_faults(job, plan)
    except chaos.ChaosError as e:  # the job did not get where it should have: a failed demo, not a usage error
        result["error"] = str(e)
    finally:
        leftovers = chaos.matching_processes(ref.markers + job.markers)
        result["leftover_processes"] = [chaos.describe(p) for p in leftovers]
        chaos.stop_all(leftovers)
    result["loss_logs"] = compare_loss_logs(ref.loss_log, job.loss_log, args.steps)
    result["ok"] = _all_good(result)
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


def _run_reference(ref: TrainerJob) -> dict[str, Any]:
    ref.write_config()
    print(f"[1/2] uninterrupted: {ref.steps} steps on {ref.nproc} CPU ranks under `ftsup run` ...", flush=True)
    t0 = time.monotonic()
    proc = start_supervisor(ref, "1")
    try:
        rc = wait_exit(proc, RUN_TIMEOUT_S, "the uninterrupted run")
    finally:
        stop_supervisor(proc, ref)
    wall = round(time.monotonic() - t0, 1)
    print(f"      ftsup run exited {rc} after {wall} s", flush=True)
    return {"exit_code": rc, "wall_s": wall}


def _run_with_faults(job: TrainerJob, plan: Sequence[Fault]) -> tuple[list[dict[str, Any]], list[int]]:
    job.write_config()
    print(f"[2/2] the same job, with faults injected from outside at steps {[f.at_step for f in plan]} ...", flush=True)
    records: list[dict[str, Any]] = []
    codes: list[int] = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    proc: subprocess.Popen[bytes] | None = start_supervisor(job, "1")
    try:
        with chaos.LossLogTail(job.loss_log) as tail:
            for fault in plan:
                tail.wait_for_step(fault.at_step, deadline - time.monotonic())
                assert proc is not None
                if fault.kind == "kill-supervisor":
                    rec, proc = sigkill_supervisor_and_restart(job, proc, tail, deadline - time.monotonic())
                    codes.append(-signal.SIGKILL)
                else:
                    rec = _fault_rank(job, fault, tail, deadline)
                rec.update(kind=fault.kind, label=fault.label(), at_step=fault.at_step)
                records.append(rec)
                print(f"      {_fault_line(rec)}", flush=True)
            assert proc is not None
            codes.append(wait_exit(proc, max(1.0, deadline - time.monotonic()), "the faulted run"))
            # Fill in detection and recovery from the complete logs, now that the run is over.
            for rec in records:
                if rec["kind"] != "kill-supervisor":
                    rec.update(fault_timeline(job, tail, rec["t_fault"]))
    finally:
        stop_supervisor(proc, job)
    print(f"      ftsup run exit codes: {codes}", flush=True)
    return records, codes


def _fault_rank(job: TrainerJob, fault: Fault, tail: chaos.LossLogTail, deadline: float) -> dict[str, Any]:
    assert fault.rank is not None
    ranks = chaos.wait_for_ranks(lambda: chaos.supervised_ranks(job.state_dir), job.nproc, 30)
    target = ranks[fault.rank]
    sig = signal.SIGKILL if fault.kind == "kill-rank" else signal.SIGSTOP
    t = chaos.send(target, sig)
    wait_resumed(job, tail, t, deadline - time.monotonic())
    return {"t_fault": t, "pid": target.pid, "rank": fault.rank, **fault_timeline(job, tail, t)}


# --------------------------------------------------------------------------- checks and the report


def compare_loss_logs(reference: Path, faulted: Path, steps: int) -> dict[str, Any]:
    """Each step's last line of both logs, compared bitwise through `loss_hex`."""
    ref, got = chaos.last_line_per_step(reference), chaos.last_line_per_step(faulted)
    expected = list(range(1, steps + 1))
    mismatched = [s for s in expected if s not in ref or s not in got or ref[s]["loss_hex"] != got[s]["loss_hex"]]
    return {
        "steps_expected": steps,
        "reference_steps": len(ref),
        "faulted_steps": len(got),
        "mismatched_steps": mismatched,
        "bitwise_equal": not mismatched and sorted(got) == expected,
        "final_loss": got[steps]["loss"] if steps in got else None,
    }


def _all_good(r: dict[str, Any]) -> bool:
    faults = r.get("faults") or []
    recovered = all(f.get("recover_s") is not None for f in faults)
    detected = all(f.get("detected_by") for f in faults if f["kind"] != "kill-supervisor")
    adopted = all(f.get("journal_adopted") and not f.get("orphans") for f in faults if f["kind"] == "kill-supervisor")
    return bool(
        r["error"] is None
        and r.get("reference", {}).get("exit_code") == 0
        and (r.get("exit_codes") or [None])[-1] == 0
        and faults
        and recovered
        and detected
        and adopted
        and r["loss_logs"]["bitwise_equal"]
        and not r["leftover_processes"]
    )


def _fault_line(f: dict[str, Any]) -> str:
    head = f"step {f.get('max_step_before', '?'):>3}  {f['label']}"
    if f["kind"] == "kill-supervisor":
        gone = f"job gone after {f['job_gone_s']} s" if f.get("job_gone_s") is not None else "job NOT gone"
        return (
            f"{head}: {gone}, {len(f['orphans'])} orphan(s); new supervisor "
            f"{'adopted the journal' if f['journal_adopted'] else 'did NOT adopt the journal'}, resumed from "
            f"checkpoint {f.get('resume_step')} -> first step after {f['recover_s']} s"
        )
    return f"{head}: first step after the relaunch {f.get('recover_s')} s later"


def _describe_fault(f: dict[str, Any]) -> list[str]:
    lines = [f"  step {f.get('max_step_before', '?'):>3}  {f['label']} (pid {f['pid']})"]
    if f["kind"] == "kill-supervisor":
        gone = f"in {f['job_gone_s']} s" if f.get("job_gone_s") is not None else "NOT within 30 s"
        lines.append(
            f"            its torchrun and ranks ({f['processes_of_the_job']} processes) exited {gone}; "
            f"orphans: {len(f['orphans'])}"
        )
        lines.append(
            f"            new `ftsup run`: journal adopted: {f['journal_adopted']} (attempt "
            f"{f['adopted_attempt']}), attempt {f['attempt']} from checkpoint {f['resume_step']}"
        )
    elif f.get("detected_by"):
        lines.append(f"            detected by {f['detected_by']} after {f['detect_s']} s: {f.get('reason')}")
    else:
        lines.append("            NOT detected")
    if f.get("recover_s") is not None:
        load = f", checkpoint load {f['load_s']} s" if f.get("load_s") is not None else ""
        lines.append(
            f"            resumed from checkpoint {f.get('resume_step')}: step {f['first_step']} logged "
            f"{f['recover_s']} s after the fault{load}; {f['lost_steps']} step(s) redone"
        )
    else:
        lines.append("            NOT recovered")
    return lines


def report(r: dict[str, Any]) -> str:
    lines = ["", f"ftsup demo: {r['steps']} steps, world size {r['world_size']}, in {r['dir']}"]
    ref = r.get("reference", {})
    lines.append(f"uninterrupted run: exit {ref.get('exit_code')} after {ref.get('wall_s')} s")
    lines.append(f"faulted run: exit codes {r.get('exit_codes')} (-9: the supervisor SIGKILLed on purpose)")
    for f in r.get("faults") or []:
        lines.extend(_describe_fault(f))
    cmp = r["loss_logs"]
    if cmp["bitwise_equal"]:
        lines.append(
            f"loss logs: all {cmp['steps_expected']} steps bitwise equal (loss_hex) to the uninterrupted run; "
            f"final loss {cmp['final_loss']}"
        )
    else:
        lines.append(
            f"loss logs DIFFER: {len(cmp['mismatched_steps'])} step(s) missing or unequal: "
            f"{cmp['mismatched_steps'][:20]}"
        )
    left = r["leftover_processes"]
    lines.append(f"processes of either job left running: {len(left)}")
    if r["error"]:
        lines.append(f"stopped early: {r['error']}")
    lines.extend(f"  {d}" for d in left)
    lines.append(
        "PASS: every fault detected and recovered, losses bitwise equal, nothing left running" if r["ok"] else "FAIL"
    )
    return "\n".join(lines)
