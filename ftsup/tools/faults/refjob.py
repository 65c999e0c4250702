"""The reference trainer as a supervised job, run and read from outside, for `ftsup demo` and the benchmarks:
`TrainerJob` (one small CPU job in a directory of its own: flags, config, logs, process marks), `ftsup run` started
and stopped as an operator would (`start_supervisor`, `stop_supervisor`, `wait_exit`), and what the logs say
followed a fault (`fault_timeline`). Never imports torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

import ftsup
from ftsup import guard, procs
from ftsup.tools.faults import chaos

# Where `import ftsup` is found (the repository, or site-packages after `pip install`): the ranks' PYTHONPATH.
CODE_ROOT = Path(ftsup.__file__).resolve().parents[1]
SUPERVISOR_STOP_S = 30.0  # a supervisor stops its job within its stop grace; then it is killed


@dataclass(frozen=True)
class TrainerJob:
    """The reference trainer on 2 CPU ranks, small enough for seconds per attempt, in `root`."""

    root: Path
    run_id: str
    steps: int
    ckpt_every: int = 5
    min_step_s: float = 0.1  # every step lasts at least this, so faults can be aimed at a step
    nproc: int = 2
    extra_args: tuple[str, ...] = ()
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)  # extra config, e.g. {"restart": {...}}
    store: Path | None = None  # the checkpoint dir when not <root>/ckpt (one on a filesystem of its own)
    command: tuple[str, ...] = ()  # another training command than the reference trainer (`trainer_args`)

    @property
    def ckpt_dir(self) -> Path:
        return self.store if self.store is not None else self.root / "ckpt"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def supervisor_log(self) -> Path:
        return self.log_dir / "supervisor.jsonl"

    @property
    def loss_log(self) -> Path:
        return self.root / "loss.jsonl"

    @property
    def config_path(self) -> Path:
        return self.root / "job.yaml"

    @property
    def markers(self) -> list[str]:
        """Strings that only this job's processes carry (command line or environment): its
        supervisor (the config path), torchrun and the ranks (the checkpoint dir, the run id)."""
        return [str(self.config_path), str(self.ckpt_dir), f"FTSUP_RUN_ID={self.run_id}"]

    def trainer_args(self) -> list[str]:
        """Arguments after `-m ftsup.trainer.examples.gpt`."""
        argv = ["--steps", str(self.steps), "--ckpt-every", str(self.ckpt_every)]
        argv += ["--n-layer", "2", "--n-embd", "64", "--seq-len", "32", "--corpus-bytes", "200000"]
        argv += ["--min-step-s", str(self.min_step_s), "--ckpt-dir", str(self.ckpt_dir)]
        return [*argv, "--loss-log", str(self.loss_log), *self.extra_args]

    def config(self) -> dict[str, Any]:
        """The job's config as a mapping (`write_config` writes it)."""
        cfg: dict[str, Any] = {
            "job": {
                "command": list(self.command)
                or [sys.executable, "-m", "ftsup.trainer.examples.gpt", *self.trainer_args()],
                "workdir": str(self.root),
                "state_dir": str(self.state_dir),
                "run_id": self.run_id,
                "env": {"PYTHONPATH": _pythonpath()},
            },
            "launch": {"nproc_per_node": self.nproc},
            "checkpoint": {"dir": str(self.ckpt_dir)},
        }
        for name, values in self.sections.items():
            cfg.setdefault(name, {}).update(values)
        return cfg

    def write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        return self.config_path


def new_run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _pythonpath() -> str:
    old = os.environ.get("PYTHONPATH")
    return str(CODE_ROOT) + (os.pathsep + old if old else "")


def child_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def start_guarded(argv: list[str], *, env: dict[str, str], cwd: Path, out_path: Path) -> subprocess.Popen[bytes]:
    """Start `argv` behind the parent-death guard, output appended to `out_path`: if the demo or
    benchmark is killed, what it started goes too (a supervisor takes its job along)."""
    wrapped, guard_env = guard.wrap(argv)
    with open(out_path, "ab") as out:
        return subprocess.Popen(
            wrapped, env={**env, **guard_env}, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )


def start_supervisor(job: TrainerJob, tag: str) -> subprocess.Popen[bytes]:
    """`ftsup run --config` as a subprocess, its output in `<root>/supervisor-<tag>.out`."""
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job.config_path)]
    return start_guarded(argv, env=child_env(), cwd=job.root, out_path=job.root / f"supervisor-{tag}.out")


def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise chaos.ChaosError(f"{what} did not finish within {timeout_s:g} s") from None


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """Cleanup after an error: SIGTERM to a supervisor we started (it stops its job), SIGKILL after its grace."""
    if proc is not None and proc.poll() is None:
        try:
            supervisor = [psutil.Process(proc.pid)]
        except psutil.NoSuchProcess:
            supervisor = []
        procs.stop(lambda: supervisor, SUPERVISOR_STOP_S, reap=proc.poll)
        proc.wait(timeout=10)


def stop_supervisor(proc: subprocess.Popen[bytes] | None, job: TrainerJob) -> None:
    """Cleanup after an error: the supervisor stopped (`stop_process`), then whatever of its job is left SIGKILLed."""
    stop_process(proc)
    chaos.stop_all(chaos.matching_processes(job.markers))


def wait_resumed(job: TrainerJob, tail: chaos.LossLogTail, after: float, timeout_s: float) -> chaos.LossLine:
    """The first loss line of the attempt launched after wall time `after`."""

    def resumed() -> chaos.LossLine | None:
        launched = chaos.first_event(chaos.read_events(job.supervisor_log), ["workers_launched"], after)
        return tail.first_after(launched.t) if launched is not None else None

    return chaos.poll_until(resumed, timeout_s, "the first step after the relaunch", interval_s=0.05)


def sigkill_supervisor_and_restart(
    job: TrainerJob, proc: subprocess.Popen[bytes], tail: chaos.LossLogTail, timeout_s: float, delay_s: float = 0.0
) -> tuple[dict[str, Any], subprocess.Popen[bytes]]:
    """SIGKILL the supervisor, wait for its job to go (torchrun and every rank run behind the
    parent-death guard), count what is left, then start `ftsup run` again, `delay_s` after the kill at
    the earliest (systemd's RestartSec), and wait for its first resumed step. Returns what was seen and
    the new supervisor process."""
    procs = chaos.job_processes(job.state_dir)
    t = chaos.kill_process(proc.pid)
    proc.wait(timeout=10)
    try:
        chaos.poll_until(lambda: not chaos.matching_processes(job.markers), 30, "the job exiting", interval_s=0.05)
        gone_s: float | None = _ms(time.time() - t)
    except chaos.ChaosError:
        gone_s = None
    left = chaos.matching_processes(job.markers)
    max_step = tail.max_step(before=t)
    time.sleep(max(0.0, t + delay_s - time.time()))  # the service manager's restart delay, not a wait for an event
    t_restart = time.time()
    new = start_supervisor(job, f"restart-{int(t_restart)}")
    line = wait_resumed(job, tail, t_restart, timeout_s)
    events = chaos.read_events(job.supervisor_log)
    adopted = chaos.first_event(events, ["journal_adopted"], t_restart)
    launched = chaos.first_event(events, ["workers_launched"], t_restart)
    attempt = int(launched.fields.get("attempt", 0)) if launched else 0
    seen = {
        "t_fault": t,
        "pid": proc.pid,
        "processes_of_the_job": len(procs),
        "job_gone_s": gone_s,
        "orphans": [chaos.describe(p) for p in left],
        "max_step_before": max_step,
        "journal_adopted": adopted is not None,
        "adopted_attempt": adopted.fields.get("attempt") if adopted else None,
        "attempt": attempt,
        "resume_step": launched.fields.get("resume_step") if launched else None,
        "restart_to_first_step_s": _ms(line.t - t_restart),
        "recover_s": _ms(line.t - t),
        "first_step": line.step,
        "lost_steps": max_step - (line.step - 1),
        "load_s": chaos.attempt_load_s(job.log_dir, attempt),
    }
    return seen, new


def fault_timeline(job: TrainerJob, tail: chaos.LossLogTail, t_fault: float) -> dict[str, Any]:
    """What the logs say followed a fault at wall time `t_fault` (seconds, rounded to ms):

    detected_by, reason, timeout_s, detect_s: the supervisor's first failure event after the fault;
    attempt, resume_step: its next `workers_launched`; first_step, recover_s: the first loss line
    after that launch (lines of the old attempt cannot appear by then); lost_steps: steps logged
    before the launch that had to be redone; split: recover_s as detection (-> failure event),
    teardown (-> `restart_scheduled`), backoff (-> `workers_launched`: backoff, health probe,
    checkpoint choice), launch (-> first step, less the load) and load (the slowest rank's
    `checkpoint_loaded duration_s` in the attempt log). Keys whose event never came are absent.
    """
    events = chaos.read_events(job.supervisor_log)
    out: dict[str, Any] = {"max_step_before": tail.max_step(before=t_fault)}
    failure = chaos.first_event(events, chaos.FAILURE_EVENTS, t_fault)
    if failure is None:
        return out
    out.update(
        detected_by=failure.event,
        reason=failure.fields.get("reason"),
        timeout_s=failure.fields.get("timeout_s"),
        detect_s=_ms(failure.t - t_fault),
    )
    scheduled = chaos.first_event(events, ["restart_scheduled"], failure.t)
    launched = chaos.first_event(events, ["workers_launched"], failure.t)
    if launched is None:
        return out
    attempt = int(launched.fields.get("attempt", 0))
    out.update(attempt=attempt, resume_step=launched.fields.get("resume_step"))
    line = tail.first_after(launched.t)
    if line is None:
        return out
    load = chaos.attempt_load_s(job.log_dir, attempt)
    out["max_step_before"] = tail.max_step(before=launched.t)
    out.update(
        first_step=line.step,
        recover_s=_ms(line.t - t_fault),
        lost_steps=out["max_step_before"] - (line.step - 1),
        load_s=load,
    )
    if scheduled is not None:
        out["split"] = {
            "detection_s": _ms(failure.t - t_fault),
            "teardown_s": _ms(scheduled.t - failure.t),
            "backoff_s": _ms(launched.t - scheduled.t),
            "launch_s": _ms(line.t - launched.t - (load or 0.0)),
            "load_s": load,
        }
    return out


def _ms(seconds: float) -> float:
    return round(seconds, 3)
