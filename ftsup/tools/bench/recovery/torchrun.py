"""torchrun's side of `ftsup bench recovery`: the same job under plain `torchrun --max-restarts=3`, the trainer
resuming from its --ckpt-dir by itself. Its only observable reaction to a fault is new worker processes; a wait for
its recovery is capped at --hang-wait-s, then it is stopped with SIGTERM. A kill it does not recover from is
measured again with the workaround of pytorch/pytorch#135712, in a row of its own.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ftsup import procs
from ftsup.tools.bench.recovery.common import STEP_GAP, aim, load_average, rounded, row, wait_aimed
from ftsup.tools.faults import chaos
from ftsup.tools.faults.refjob import TrainerJob, child_env, new_run_id, start_guarded, wait_exit

MAX_RESTARTS = 3
WORKAROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch/pytorch#135712
WORKAROUND_TEXT = " ".join(f"{k}={v}" for k, v in WORKAROUND.items())
SIGTERM_WAIT_S = 45.0


def bench_torchrun(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = [_with_load(_kill, root / "kill", args, {})]
    if rows[0]["recover_s"] is None:
        # Plain torchrun could not restart; measure it once more with the documented workaround,
        # so that there is a recovery time to compare with, and say which row is which.
        rows.append(_with_load(_kill, root / "kill-unshared-store", args, dict(WORKAROUND)))
    rows.append(_with_load(_hang, root / "hang", args))
    return rows


def _with_load(scenario: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run one scenario and note the load average around it: on a shared machine the timings move with it."""
    before = load_average()
    out = scenario(*args)
    out["loadavg"] = {"start": before, "end": load_average()}
    return out


def _start(job: TrainerJob, out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    job.root.mkdir(parents=True, exist_ok=True)
    launch_flags = ["--standalone", f"--nproc-per-node={job.nproc}", f"--max-restarts={MAX_RESTARTS}"]
    argv = [sys.executable, "-m", "torch.distributed.run", *launch_flags, "-m", "ftsup.trainer.examples.gpt"]
    argv += job.trainer_args()
    return start_guarded(argv, env=child_env(**env), cwd=job.root, out_path=out)


def _worker_pids(agent: int) -> frozenset[int]:
    try:
        return frozenset(c.pid for c in psutil.Process(agent).children() if procs.alive(c))
    except psutil.NoSuchProcess:
        return frozenset()


def _kill(root: Path, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    repeats = min(args.repeats, MAX_RESTARTS)
    job = TrainerJob(root, new_run_id("bench-torchrun"), 12 + repeats * (STEP_GAP + 7) + 20, min_step_s=args.min_step_s)
    variant = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"torchrun --max-restarts={MAX_RESTARTS} {variant}: {repeats} kill(s) in one job", flush=True)
    measured: list[dict[str, Any]] = []
    out = root / "torchrun.out"
    teardown_s: float | None = None
    proc = _start(job, out, env)
    try:
        with chaos.LossLogTail(job.loss_log) as tail:
            best = 0
            for _ in range(repeats):
                wait_aimed(job, tail, aim(best + STEP_GAP, job.ckpt_every), 180, proc)
                if proc.poll() is not None:
                    break
                ranks = chaos.wait_for_ranks(lambda: chaos.ranks_under(proc.pid), job.nproc, 60)
                old = _worker_pids(proc.pid)
                t = chaos.send(ranks[1], signal.SIGKILL)
                f = _recovery(proc, old, tail, t, args.hang_wait_s)
                measured.append(f)
                got = "no resumed step" if f["recover_s"] is None else f"resumed after {f['recover_s']:.2f} s"
                print(f"  kill: {got}", flush=True)
                if f["recover_s"] is None:
                    break
                best = tail.max_step()
            if measured and measured[-1]["recover_s"] is None and proc.poll() is None:
                teardown_s = sigterm(proc)  # it gave up or hangs: stop it as an operator would
            code = wait_exit(proc, 300, "the torchrun job")
    finally:
        _stop(proc, job)
    text = out.read_text(errors="replace")
    loads = chaos.load_durations(text)
    for f in measured:
        if f.get("split") is not None and loads:
            f["split"]["load_s"] = max(loads)  # per-rank load times; the slowest stands for each restart
            f["split"]["launch_s"] = rounded(f["split"]["launch_s"] - max(loads))
    left = chaos.matching_processes(job.markers)
    chaos.stop_all(left)
    notes = ["detect_s: fault -> torchrun's new worker processes (its teardown and re-rendezvous included)"]
    if env:
        notes.insert(0, f"with {variant} (the workaround of pytorch/pytorch#135712)")
    if not measured or measured[-1]["recover_s"] is None:
        how = (
            "restarted workers failed in init_process_group (Gloo connectFullMesh: Connection refused)"
            if "connectFullMesh failed" in text
            else "restarted workers never logged a step"
        )
        ended = f"exited {code}" if teardown_s is None else f"stopped with SIGTERM, exited {code} after {teardown_s} s"
        recovered = sum(1 for f in measured if f["recover_s"] is not None)
        notes.insert(
            0,
            f"recovered from {recovered} of {len(measured)} kills, then no recovery: {how}; torchrun "
            f"{ended}" + ("" if env else f"; with {WORKAROUND_TEXT} see the next row"),
        )
    if repeats < args.repeats:
        notes.append(f"{repeats} repeats, not {args.repeats}: --max-restarts={MAX_RESTARTS} allows no more")
    out_row = {**row("torchrun", "kill", measured or [{"recover_s": None}], "; ".join(notes)), "orphans": len(left)}
    out_row["exit_code"] = code
    if env:
        out_row["variant"] = variant
    return out_row


def _recovery(
    proc: subprocess.Popen[bytes], old: frozenset[int], tail: chaos.LossLogTail, t: float, timeout_s: float
) -> dict[str, Any]:
    """Wait for torchrun's restart (new worker pids) and the first step after it, or for torchrun to give up."""
    deadline = time.monotonic() + timeout_s
    restarted: float | None = None
    while time.monotonic() < deadline and proc.poll() is None:
        if restarted is None:
            if _worker_pids(proc.pid) - old:
                restarted = time.time()
        else:
            line = tail.first_after(restarted)
            if line is not None:
                return {
                    "detect_s": rounded(restarted - t),
                    "recover_s": rounded(line.t - t),
                    "resume_step": line.step - 1,
                    "lost_steps": tail.max_step(before=restarted) - (line.step - 1),
                    "split": {"detection_s": rounded(restarted - t), "launch_s": line.t - restarted, "load_s": None},
                }
        time.sleep(chaos.POLL_S)
    return {"detect_s": rounded(restarted - t) if restarted else None, "recover_s": None, "lost_steps": None}


def _hang(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    job = TrainerJob(root, new_run_id("bench-torchrun-hang"), 60, min_step_s=args.min_step_s)
    print(f"torchrun --max-restarts={MAX_RESTARTS}: SIGSTOP rank 0, waiting up to {args.hang_wait_s:g} s", flush=True)
    proc = _start(job, root / "torchrun.out", {})
    try:
        with chaos.LossLogTail(job.loss_log) as tail:
            wait_aimed(job, tail, aim(0, job.ckpt_every), 180, proc)
            ranks = chaos.wait_for_ranks(lambda: chaos.ranks_under(proc.pid), job.nproc, 60)
            old = _worker_pids(proc.pid)
            t = chaos.send(ranks[0], signal.SIGSTOP)
            f = _recovery(proc, old, tail, t, args.hang_wait_s)
            teardown_s = sigterm(proc)
            left = chaos.matching_processes(job.markers)
    finally:
        _stop(proc, job)
    if f.get("recover_s") is None:
        note = (
            f"no recovery within {args.hang_wait_s:g} s: torchrun reacts only to exits, and the other rank waits "
            "in a gloo collective (default timeout 30 min)"
        )
    else:
        note = "recovered"
    note += (
        f"; after SIGTERM torchrun exited in {teardown_s} s"
        if teardown_s is not None
        else f"; torchrun did not exit within {SIGTERM_WAIT_S:g} s of SIGTERM"
    )
    return {**row("torchrun", "hang", [f], note), "orphans": len(left), "teardown_after_sigterm_s": teardown_s}


def sigterm(proc: subprocess.Popen[bytes], timeout_s: float = SIGTERM_WAIT_S) -> float | None:
    """What an operator (or Slurm's scancel) does to a job that does not recover: SIGTERM the
    launcher; returns how long it took to exit, None when it did not within `timeout_s`."""
    if proc.poll() is not None:
        return 0.0
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    return rounded(time.time() - t)


def _stop(proc: subprocess.Popen[bytes], job: TrainerJob) -> None:
    chaos.stop_all(chaos.tree([proc.pid]) + chaos.matching_processes(job.markers))
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
