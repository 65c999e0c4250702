"""Node loss for `ftsup chaos`: the reference trainer as one job of two nodes on this machine, each a supervisor with
one rank (c10d on 127.0.0.1, `launch.nnodes: "1:2"`), and node B lost as a machine is (its supervisor SIGKILLed,
the rest following through the parent-death guard), then started again `restart_s` later (docs/chaos.md).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ftsup.protocol import NODE_ID_ENV
from ftsup.store import layout
from ftsup.tools.faults import chaos
from ftsup.tools.faults.inject import stale_after_relaunch
from ftsup.tools.faults.plan import KINDS, Planned
from ftsup.tools.faults.refjob import TrainerJob, child_env, start_guarded, stop_process, wait_exit

NODES = ("node-a", "node-b")
RDZV_CONF = "--rdzv-conf=last_call_timeout=2,join_timeout=120,read_timeout=10"  # as tests/integration/test_multinode.py


@dataclass(frozen=True)
class NodeJob:
    """The two-node job in `base.root`: `base` holds the trainer's flags (its `nproc` is each node's)."""

    base: TrainerJob
    port: int

    def state_dir(self, node: str) -> Path:
        return self.base.root / node

    def config_path(self, node: str) -> Path:
        return self.base.root / f"{node}.yaml"

    def log(self, node: str) -> Path:
        return self.state_dir(node) / "logs" / "supervisor.jsonl"

    def node_id(self, node: str) -> str:
        """The node's id, this run's alone: another job on the host may have a node named `node` too."""
        return f"{self.base.run_id}-{node}"

    def markers(self, node: str) -> list[str]:
        """What only this node's processes carry: its config path (the supervisor), its node id (the rest)."""
        return [str(self.config_path(node)), f"{NODE_ID_ENV}={self.node_id(node)}"]

    def write_configs(self, losses: int) -> None:
        """Both nodes' configs; the restart budget covers `losses` node losses (each may cost the survivor a
        restart for the loss and a few while the node rejoins: torchrun's rendezvous times out under load)."""
        for node in NODES:
            cfg = self.base.config()
            cfg["job"]["state_dir"] = str(self.state_dir(node))
            cfg["launch"].update(
                nnodes="1:2",
                rdzv_endpoint=f"127.0.0.1:{self.port}",
                node_id=self.node_id(node),
                torchrun_args=[RDZV_CONF],
            )
            cfg.setdefault("restart", {}).update(backoff_initial_s=0.5, max_restarts=5 * losses + 10)
            self.base.root.mkdir(parents=True, exist_ok=True)
            self.config_path(node).write_text(yaml.safe_dump(cfg, sort_keys=False))

    def start(self, node: str, tag: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(self.config_path(node))]
        return start_guarded(argv, env=child_env(), cwd=self.base.root, out_path=self.base.root / f"{node}-{tag}.out")


def run(job: NodeJob, faults: list[Planned], restart_s: float, timeout_s: float) -> dict[str, Any]:
    """Both nodes started; each fault of `faults` (node-loss) thrown in turn; both waited for. Returns the
    records of the faults, the exit statuses of the last runs of each node and an error that cut it short."""
    job.write_configs(len(faults))
    procs: dict[str, subprocess.Popen[bytes] | None] = {n: job.start(n, "1") for n in NODES}
    records: list[dict[str, Any]] = []
    out: dict[str, Any] = {"faults": records, "exit_codes": {}, "error": None, "left": []}
    try:
        with chaos.LossLogTail(job.base.loss_log) as tail:
            together = tail.wait_for(lambda ln: ln.record.get("world_size") == 2, timeout_s, "two nodes training")
            best = together.step
            for f in faults:
                _wait_step(tail, best + f.gap_steps, procs, timeout_s)
                time.sleep(f.delay_frac * job.base.min_step_s)  # where within the step it lands: the plan's draw
                rec: dict[str, Any] = {
                    "index": f.index,
                    "kind": f.kind,
                    "label": KINDS[f.kind],
                    "node": NODES[1],
                    "at_step": tail.max_step(),
                    "newest_before": _newest(job),
                }
                try:
                    rec.update(_lose_node(job, procs, tail, restart_s, timeout_s))
                except chaos.ChaosError as e:
                    rec["error"] = str(e)
                    records.append(rec)
                    raise
                records.append(rec)
                best = max(best, tail.max_step())
            for node in NODES:
                p = procs[node]
                if p is not None:
                    out["exit_codes"][node] = wait_exit(p, timeout_s + job.base.steps, f"{node}'s supervisor")
            markers = [m for n in NODES for m in job.markers(n)]
            out["left"] = [chaos.describe(p) for p in chaos.matching_processes(markers)]  # before any cleanup
    except chaos.ChaosError as e:
        out["error"] = str(e)
    finally:
        for node in NODES:
            stop_process(procs[node])
            chaos.stop_all(chaos.matching_processes(job.markers(node)))
    return out


def _lose_node(
    job: NodeJob,
    procs: dict[str, subprocess.Popen[bytes] | None],
    tail: chaos.LossLogTail,
    restart_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    lost = NODES[1]
    proc = procs[lost]
    if proc is None:
        raise chaos.ChaosError(f"{lost} is not running")
    trained = tail.max_step()
    t_fault = chaos.kill_process(proc.pid)
    proc.wait(timeout=10)
    procs[lost] = None
    try:
        chaos.poll_until(lambda: not chaos.matching_processes(job.markers(lost)), 30, f"{lost}'s processes going")
        orphans: list[str] = []
    except chaos.ChaosError:
        orphans = [chaos.describe(p) for p in chaos.matching_processes(job.markers(lost))]
    alone = _wait_line(
        tail,
        lambda ln: ln.t > t_fault and ln.record.get("world_size") == 1,
        procs,
        timeout_s,
        "the surviving node training alone",
    )
    resumed = {**_resumed(job, alone.step), **_timeline(job, t_fault)}
    time.sleep(max(0.0, t_fault + restart_s - time.time()))  # the replaced machine's boot, not a wait for an event
    t_back = time.time()
    procs[lost] = job.start(lost, f"back-{int(t_back)}")
    rejoined = _wait_line(
        tail, lambda ln: ln.t > t_back and ln.record.get("world_size") == 2, procs, timeout_s, f"{lost} rejoining"
    )
    stale = stale_after_relaunch(
        job.base.run_id, lambda: {job.node_id(n): chaos.journal_attempt(job.state_dir(n)) for n in NODES}
    )
    return {
        "t_fault": t_fault,
        "max_step_before": trained,
        "orphans": orphans,
        "first_step": alone.step,
        "recover_s": round(alone.t - t_fault, 3),
        "lost_steps": trained - (alone.step - 1),
        "world_size_after": 1,
        "rejoin_s": round(rejoined.t - t_back, 3),
        "rejoined_at_step": rejoined.step,
        **resumed,
        "stale_processes": stale,
    }


def _resumed(job: NodeJob, first_step: int) -> dict[str, Any]:
    loaded = first_step - 1
    consistent: bool | None = None
    if loaded > 0:
        try:
            consistent = layout.find_checkpoint(job.base.ckpt_dir, loaded, deep=True).consistent
        except layout.NoCheckpointError:
            consistent = False
    return {"loaded_step": loaded, "loaded_consistent": consistent}


def _timeline(job: NodeJob, t_fault: float) -> dict[str, Any]:
    """The surviving node's first failure event after the loss: how it was detected, and when."""
    events = chaos.read_events(job.log(NODES[0]))
    failure = chaos.first_event(events, chaos.FAILURE_EVENTS, t_fault)
    if failure is None:
        return {}
    return {
        "detected_by": failure.event,
        "reason": failure.fields.get("reason"),
        "detect_s": round(failure.t - t_fault, 3),
    }


def _newest(job: NodeJob) -> int | None:
    info = layout.latest_consistent(job.base.ckpt_dir)
    return info.step if info else None


def _wait_step(
    tail: chaos.LossLogTail, step: int, procs: dict[str, subprocess.Popen[bytes] | None], timeout_s: float
) -> None:
    _wait_line(tail, lambda ln: ln.step >= step, procs, timeout_s, f"step {step}")


def _wait_line(
    tail: chaos.LossLogTail,
    pred: Callable[[chaos.LossLine], bool],
    procs: dict[str, subprocess.Popen[bytes] | None],
    timeout_s: float,
    what: str,
) -> chaos.LossLine:
    """The first loss line that satisfies `pred`; a ChaosError as soon as a node's supervisor has exited."""

    def seen() -> chaos.LossLine | None:
        for node, p in procs.items():
            if p is not None and p.poll() is not None:
                raise chaos.ChaosError(f"{node}'s supervisor exited {p.returncode} before {what}")
        return next((ln for ln in tail.lines() if pred(ln)), None)

    return chaos.poll_until(seen, timeout_s, what)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it): the rendezvous endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
