"""Throwing one planned fault (`plan.Planned`) at the one-node job of `ftsup chaos`, from outside as an operator or a
failing machine would, and what was seen right after it: detection, the first step again, the checkpoint it resumed
from (verified there and then, before retention could delete it), processes of earlier attempts. The checks are
`invariants`'; the two-node job's faults are `nodes`'.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ftsup import procs
from ftsup.protocol import ATTEMPT_ENV, NODE_ID_ENV, RUN_ID_ENV
from ftsup.store import layout
from ftsup.store.errors import CheckpointError
from ftsup.tools.faults import chaos
from ftsup.tools.faults.diskfull import Disk
from ftsup.tools.faults.metadata_server import MetadataServer
from ftsup.tools.faults.plan import DISK_FULL_STEPS, KINDS, STRAGGLER_STEPS, Planned
from ftsup.tools.faults.refjob import (
    TrainerJob,
    fault_timeline,
    sigkill_supervisor_and_restart,
    start_supervisor,
    wait_exit,
    wait_resumed,
)

STRAGGLE_STOP_S, STRAGGLE_RUN_S = 0.15, 0.1  # the straggler's turns: stopped, then running
RESTART_KINDS = frozenset({"kill-rank", "stop-rank", "exit-rank", "kill-torchrun", "flip-byte", "kill-in-commit"})


@dataclass
class Target:
    """The one-node job under chaos: its supervisor (replaced when restarted), its loss log followed, the
    metadata server its watchers poll, the tmpfs its store is on (None: disk-full is not thrown)."""

    job: TrainerJob
    proc: subprocess.Popen[bytes]
    tail: chaos.LossLogTail
    server: MetadataServer
    disk: Disk | None
    restart_s: float  # a restarted supervisor starts this long after it went (systemd's RestartSec; a requeue)
    timeout_s: float  # for each wait on the job
    starts: int = 1  # supervisor runs started so far
    best: int = 0  # the furthest step the job reached
    codes: list[int] = field(default_factory=list)  # the exit statuses of the supervisor runs that ended

    @property
    def fault_file(self) -> Path:
        return self.job.root / "fault.json"


def throw(t: Target, f: Planned) -> dict[str, Any]:
    """Aim `f` (its gap past the furthest step, then its fraction of a step), throw it, watch what followed."""
    _wait_step(t, t.best + f.gap_steps)
    time.sleep(f.delay_frac * t.job.min_step_s)  # where within the step it lands: the plan's draw
    rec: dict[str, Any] = {
        "index": f.index,
        "kind": f.kind,
        "label": KINDS[f.kind],
        "variant": f.variant,
        "rank": f.rank,
        "at_step": t.tail.max_step(),
        "newest_before": _newest(t.job),
    }
    rec.update(_THROW[f.kind](t, f, rec))
    rec["at_step"] = t.tail.max_step(before=rec["t_fault"])  # the last step logged when it landed
    t.best = max(t.best, t.tail.max_step())
    return rec


def ask_trainer(path: Path, **asked: Any) -> None:
    """Write the reference trainer's fault file (`--fault-file`) atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asked))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- rank and agent faults


def _signal_rank(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    target = _rank(t, f.rank)
    sig = signal.SIGKILL if f.kind == "kill-rank" else signal.SIGSTOP
    t_fault = chaos.send(target, sig)
    seen = _recovered(t, t_fault, rec, pid=target.pid, stopped_rank=target.rank)
    if f.kind == "stop-rank":  # the hang's evidence: an incident record that names the rank stopped
        seen.update(chaos.hang_incident(t.job.state_dir, t_fault))
    return seen


def _exit_rank(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    target = _rank(t, f.rank)
    ask_trainer(t.fault_file, pid=target.pid, kind="exit")
    return _recovered(t, _gone(t, target.pid, "the rank asked to exit"), rec, pid=target.pid)


def _kill_torchrun(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    agents = [p for p in chaos.job_processes(t.job.state_dir) if "torch.distributed.run" in " ".join(_cmdline(p))]
    if len(agents) != 1:
        raise chaos.ChaosError(f"expected one torchrun agent of the job, found {len(agents)}")
    return _recovered(t, chaos.kill_process(agents[0].pid), rec, pid=agents[0].pid)


def _kill_in_commit(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    target = _rank(t, f.rank)
    ask_trainer(t.fault_file, pid=target.pid, kind="kill-in-commit", point=f.variant)
    t_fault = _gone(t, target.pid, f"the rank asked to die at {f.variant} of its next save")
    torn = sorted(s for e in os.scandir(t.job.ckpt_dir) if (s := layout.parse_partial_dirname(e.name)) is not None)
    return _recovered(t, t_fault, rec, pid=target.pid, torn_steps=torn)


def _flip_byte(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    """Flip a byte in a shard of the newest checkpoint once it is settled (two steps past its save, the next
    one not begun), then SIGKILL a rank so that the relaunch has to load it: it must be found corrupt,
    quarantined, and an older one loaded."""
    k = t.job.ckpt_every

    def settled() -> layout.CheckpointInfo | None:
        step = t.tail.max_step()
        newest = layout.latest_consistent(t.job.ckpt_dir)
        return newest if newest is not None and step % k == 2 and newest.step == step - 2 else None

    newest = chaos.poll_until(settled, t.timeout_s, "a settled checkpoint to flip a byte of")
    shard = Path(newest.path) / layout.shard_name(f.rank % (newest.world_size or 1))
    offset = _flip(shard, random.Random(f.index * 7919 + f.rank))
    rec["newest_before"] = _newest(t.job, exclude=newest.step)
    target = _rank(t, f.rank)
    landed = (layout.latest_consistent(t.job.ckpt_dir) or newest).step == newest.step
    seen = _recovered(t, chaos.send(target, signal.SIGKILL), rec, pid=target.pid)
    quarantined = sorted(p.name for p in t.job.ckpt_dir.glob(layout.step_dirname(newest.step) + ".corrupt*"))
    return {
        **seen,
        "flipped_step": newest.step,
        "flipped_file": shard.name,
        "flipped_offset": offset,
        "landed": landed,
        "quarantined": quarantined,
    }


def _straggler(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    """Stop and continue one rank in turns (STRAGGLE_STOP_S / STRAGGLE_RUN_S) for STRAGGLER_STEPS steps: it
    keeps beating, only slower; the job must neither fail nor restart."""
    target = _rank(t, f.rank)
    before = _step_s(t.tail)
    t0, start = time.time(), t.tail.max_step()
    deadline = time.monotonic() + t.timeout_s
    proc = target.process()
    try:
        while proc is not None and t.tail.max_step() < start + STRAGGLER_STEPS and time.monotonic() < deadline:
            proc.send_signal(signal.SIGSTOP)
            time.sleep(STRAGGLE_STOP_S)  # the straggler's turns are the fault itself, not a wait
            proc.send_signal(signal.SIGCONT)
            time.sleep(STRAGGLE_RUN_S)
    finally:
        if proc is not None and chaos.alive(proc):
            proc.send_signal(signal.SIGCONT)
    t1, end = time.time(), t.tail.max_step()
    _wait_step(t, end + 3)  # a late detection would come in these
    events = chaos.read_events(t.job.supervisor_log)
    failure = chaos.first_event(events, [*chaos.FAILURE_EVENTS, "workers_launched"], t0)
    flagged = chaos.first_event(events, ["straggler_detected"], t0)
    return {
        "t_fault": t0,
        "pid": target.pid,
        "window_s": round(t1 - t0, 3),
        "steps_in_window": end - start,
        "step_s_before": before,
        "step_s_during": round((t1 - t0) / max(1, end - start), 3),
        "restarted": failure is not None,
        "failure": failure.event if failure else None,
        "straggler_detected": flagged is not None,
    }


# --------------------------------------------------------------------------- supervisor faults


def _kill_supervisor(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    seen, t.proc = sigkill_supervisor_and_restart(t.job, t.proc, t.tail, t.timeout_s, delay_s=t.restart_s)
    t.starts += 1
    t.codes.append(-signal.SIGKILL)
    # What notices a dead supervisor is the parent-death guard of each process below it: the job gone.
    detected = "parent_death_guard" if seen["job_gone_s"] is not None else None
    return {**seen, "detected_by": detected, "detect_s": seen["job_gone_s"], **_resumed_from(t, seen["first_step"])}


def _evict_signal(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    t_fault = time.time()
    t.proc.send_signal(getattr(signal, f.variant))
    return _evicted(t, t_fault)


def _evict_metadata(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    st = t.server.state
    acks = len(st.acks)
    t_fault = time.time()
    {"aws": st.evict_aws, "gcp": st.evict_gcp, "azure": st.evict_azure}[f.variant]()
    try:
        seen = _evicted(t, t_fault, clear=lambda: st.set(aws_action=None, gcp_preempted=False, azure_events=[]))
    finally:
        st.set(aws_action=None, gcp_preempted=False, azure_events=[])
    return {**seen, "acknowledged": len(st.acks) - acks}


def _evicted(t: Target, t_fault: float, clear: Callable[[], None] | None = None) -> dict[str, Any]:
    """The supervisor noticed, saved and exited 5; the job is started again (a requeue) and resumes."""
    code = wait_exit(t.proc, t.timeout_s, "the evicted supervisor")
    t.codes.append(code)
    trained = t.tail.max_step()
    saved = layout.latest_consistent(t.job.ckpt_dir)
    left = [chaos.describe(p) for p in chaos.matching_processes(t.job.markers)]
    if clear is not None:
        clear()  # the notice is over once the machine is replaced
    time.sleep(max(0.0, t_fault + t.restart_s - time.time()))  # the requeue's delay, not a wait for an event
    t_restart = time.time()
    t.proc = start_supervisor(t.job, f"{t.starts + 1}")
    t.starts += 1
    line = wait_resumed(t.job, t.tail, t_restart, t.timeout_s)
    noticed = chaos.first_event(chaos.read_events(t.job.supervisor_log), ["eviction_noticed"], t_fault)
    return {
        "t_fault": t_fault,
        "exit_code": code,
        "max_step_before": trained,
        "saved_step": saved.step if saved else None,
        "saved_kind": saved.kind if saved else None,
        "orphans": left,
        "detected_by": noticed.event if noticed else None,
        "detect_s": round(noticed.t - t_fault, 3) if noticed else None,
        "recover_s": round(line.t - t_fault, 3),
        "lost_steps": trained - (line.step - 1),
        **_resumed_from(t, line.step),
    }


# --------------------------------------------------------------------------- storage


def _disk_full(t: Target, f: Planned, rec: dict[str, Any]) -> dict[str, Any]:
    """Fill the store's filesystem two steps before a periodic save, keep it full until a save failed (or
    DISK_FULL_STEPS save intervals went by), free it, and wait for the next save to commit; the job must
    train on throughout, restart nothing, and lose no committed checkpoint."""
    if t.disk is None:
        raise chaos.ChaosError("disk-full needs the store on a tmpfs of its own")
    k = t.job.ckpt_every
    # The steps are read off the file itself: the tail thread's view of them can lag by more than a save interval
    # on a loaded host, and a store filled then and freed by that view could miss every save.
    chaos.poll_until(lambda: t.tail.current_step() % k == k - 2, t.timeout_s, "two steps before a periodic save")
    attempt = chaos.journal_attempt(t.job.state_dir)
    failed_before = _save_failures(t.job, attempt)
    t_fault = time.time()
    took = t.disk.fill()
    start = t.tail.current_step()  # the saves after this step meet the full store
    try:
        chaos.poll_until(
            lambda: (
                _save_failures(t.job, attempt) > failed_before or t.tail.current_step() >= start + DISK_FULL_STEPS * k
            ),
            t.timeout_s,
            "a save on the full store",
        )
    finally:
        t.disk.release()
    t_release, at_release = time.time(), t.tail.current_step()  # within a poll of the failure logged, when it was

    def committed() -> layout.CheckpointInfo | None:
        info = layout.latest_consistent(t.job.ckpt_dir)
        return info if info is not None and info.step > at_release else None

    after = chaos.poll_until(committed, t.timeout_s, "a checkpoint committed after the store was freed")
    t_after = time.time()
    # A save that failed on the full store is reported before a later one commits, but its event may reach the
    # supervisor's log after the store was freed (a loaded host): counted once the later checkpoint is there.
    failed = _save_failures(t.job, attempt) - failed_before
    events = chaos.read_events(t.job.supervisor_log)
    failure = chaos.first_event(events, [*chaos.FAILURE_EVENTS, "workers_launched"], t_fault)
    return {
        "t_fault": t_fault,
        "filled_bytes": took,
        "full_s": round(t_release - t_fault, 3),
        "saves_failed": failed,
        "landed": failed > 0,
        "steps_while_full": at_release - start,
        "restarted": failure is not None,
        "failure": failure.event if failure else None,
        "committed_after": after.step,
        "recover_s": round(t_after - t_fault, 3),
        "detected_by": "checkpoint_save_failed" if failed else None,
        "detect_s": round(t_release - t_fault, 3) if failed else None,
        "lost_steps": 0,
    }


def _flip(path: Path, rng: random.Random) -> int:
    """Flip every bit of one byte of a shard's data (past its safetensors header), in place; its offset."""
    with open(path, "r+b") as fh:
        header = int.from_bytes(fh.read(8), "little")
        size = os.fstat(fh.fileno()).st_size
        offset = rng.randrange(8 + header, size)
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
        fh.flush()
        os.fsync(fh.fileno())
    return offset


# --------------------------------------------------------------------------- what followed


def _recovered(t: Target, t_fault: float, rec: dict[str, Any], **seen: Any) -> dict[str, Any]:
    """After a fault the supervisor must detect and recover from: wait for the relaunch's first step, then
    read how it was detected and what it cost from the logs (`refjob.fault_timeline`)."""
    line = wait_resumed(t.job, t.tail, t_fault, t.timeout_s)
    return {"t_fault": t_fault, **seen, **fault_timeline(t.job, t.tail, t_fault), **_resumed_from(t, line.step)}


def _resumed_from(t: Target, first_step: int) -> dict[str, Any]:
    """What the job resumed from, checked at once: the checkpoint of the step before its first (deep), and
    the processes of earlier attempts still alive."""
    loaded = first_step - 1
    consistent: bool | None = None
    if loaded > 0:
        try:
            consistent = layout.find_checkpoint(t.job.ckpt_dir, loaded, deep=True).consistent
        except CheckpointError:
            consistent = False
    attempt = chaos.journal_attempt(t.job.state_dir)
    return {
        "loaded_step": loaded,
        "loaded_consistent": consistent,
        "attempt_after": attempt,
        "stale_processes": stale_after_relaunch(t.job.run_id, lambda: {None: chaos.journal_attempt(t.job.state_dir)}),
    }


def stale_after_relaunch(run_id: str, attempts: Callable[[], dict[str | None, int]]) -> list[str]:
    """`stale_processes`, judged again by the attempts read at its end where the job moved on meanwhile (a loaded
    host: the scan takes seconds, and by its end a spare parked for the next attempt may run it). Stale is what
    both judge stale."""
    before = attempts()
    stale = _stale(run_id, before)
    after = attempts()
    if stale and after != before:
        again = {p.pid for p in _stale(run_id, after)}
        stale = [p for p in stale if p.pid in again]
    return [chaos.describe(p) for p in stale]


def stale_processes(run_id: str, attempts: dict[str | None, int]) -> list[str]:
    """Live processes of `run_id` whose attempt is not the current one of their node (`attempts`: node id ->
    attempt; the key None stands for any node), but the spare agent the supervisor parks for the next attempt
    (`launch.warm_agent`: it carries that attempt's mark from its start; DESIGN.md, "The spare agent")."""
    return [chaos.describe(p) for p in _stale(run_id, attempts)]


def _stale(run_id: str, attempts: dict[str | None, int]) -> list[psutil.Process]:
    out = []
    for p in chaos.matching_processes([f"{RUN_ID_ENV}={run_id}"]):
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone meanwhile: not stale
            continue
        current = attempts.get(env.get(NODE_ID_ENV), attempts.get(None))
        if env.get(RUN_ID_ENV) != run_id or env.get(ATTEMPT_ENV) == str(current):
            continue
        if current is not None and env.get(ATTEMPT_ENV) == str(current + 1) and _is_spare(p):
            continue
        out.append(p)
    return out


def _is_spare(p: psutil.Process) -> bool:
    """A parked spare agent: `ftsup/warmrun.py`, or the guard about to exec it, with no children yet."""
    try:
        cmdline = p.cmdline()
        children = p.children()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True  # gone meanwhile: nothing left
    return not children and any(os.path.basename(a) == "warmrun.py" for a in cmdline)


def _newest(job: TrainerJob, exclude: int | None = None) -> int | None:
    """The newest committed checkpoint that passes the fast check (other than `exclude`)."""
    for info in reversed(layout.list_checkpoints(job.ckpt_dir)):
        if info.consistent and info.step != exclude:
            return info.step
    return None


def _save_failures(job: TrainerJob, attempt: int) -> int:
    try:
        text = (job.log_dir / f"attempt-{attempt:04d}.log").read_text(errors="replace")
    except FileNotFoundError:
        return 0
    return text.count("checkpoint_save_failed")


def _rank(t: Target, rank: int) -> chaos.RankProcess:
    ranks = chaos.wait_for_ranks(lambda: chaos.supervised_ranks(t.job.state_dir), t.job.nproc, t.timeout_s)
    return ranks[rank % len(ranks)]


def _gone(t: Target, pid: int, what: str) -> float:
    chaos.poll_until(lambda: not procs.pid_alive(pid), t.timeout_s, f"{what} (pid {pid}) going")
    return time.time()


def _wait_step(t: Target, step: int) -> None:
    def reached() -> bool:
        if t.proc.poll() is not None:
            raise chaos.ChaosError(f"the supervisor exited {t.proc.returncode} before step {step}")
        return t.tail.max_step() >= step

    chaos.poll_until(reached, t.timeout_s, f"step {step}")


def _step_s(tail: chaos.LossLogTail, n: int = 6) -> float | None:
    times = [ln.t for ln in tail.lines()[-n:]]
    return round((times[-1] - times[0]) / (len(times) - 1), 3) if len(times) > 1 else None


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return list(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone meanwhile
        return []


_THROW: dict[str, Callable[[Target, Planned, dict[str, Any]], dict[str, Any]]] = {
    "kill-rank": _signal_rank,
    "stop-rank": _signal_rank,
    "exit-rank": _exit_rank,
    "kill-torchrun": _kill_torchrun,
    "kill-in-commit": _kill_in_commit,
    "flip-byte": _flip_byte,
    "straggler": _straggler,
    "kill-supervisor": _kill_supervisor,
    "evict-signal": _evict_signal,
    "evict-metadata": _evict_metadata,
    "disk-full": _disk_full,
}
