"""The heartbeat channel under `ftsup run`, attacked for real: floods, spoofed pids, another
local user, a supervisor that stalls, a long eval. The ranks are `tests/bin/beater.py` (they
only beat; no torch in the ranks), launched through torchrun as any job is.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import BIN, PYTHONPATH, REPO, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

BEATER = [sys.executable, str(BIN / "beater.py")]


class Job:
    """`ftsup run` of the beater, started in the background; `finish()` waits for its exit."""

    def __init__(self, tmp: Path, *beater_args: str, nproc: int = 2, **sections: dict) -> None:
        self.tmp = tmp
        self.done = tmp / "done"  # the beaters step until this file exists (--until)
        cfg: dict = {
            "job": {
                "command": [*BEATER, "--until", str(self.done), *beater_args],
                "workdir": str(REPO),
                "state_dir": str(tmp / "state"),
                "env": {"PYTHONPATH": PYTHONPATH},
            },
            "launch": {"nproc_per_node": nproc},
            "checkpoint": {"dir": str(tmp / "ckpt")},
            "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
            "metrics": {"listen": "127.0.0.1:0"},
        }
        for name, values in sections.items():
            cfg.setdefault(name, {}).update(values)
        (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
        env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
        with open(tmp / "stderr.log", "wb") as err:  # a file, not a pipe: nobody would drain a pipe
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(tmp / "job.yaml")],
                env=env,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )

    @property
    def run_dir(self) -> Path:
        return self.tmp / "state" / "run"

    def events(self, name: str | None = None) -> list[dict]:
        path = self.tmp / "state" / "logs" / "supervisor.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        evs = [json.loads(x) for x in lines if x.endswith("}")]
        return [e for e in evs if name is None or e["event"] == name]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        (started,) = self.events("supervisor_started")
        with urllib.request.urlopen(f"http://{started['metrics']}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics()[(name, tuple(sorted(labels.items())))]

    def step(self) -> float:
        return self.metric("ftsup_step") if self.events("supervisor_started") else -1

    def wait_for_step(self, step: float, timeout_s: float = 90) -> None:
        wait_for(
            lambda: self.proc.poll() is None and self.step() >= step,
            timeout_s,
            lambda: f"step {step} not reached (rc {self.proc.poll()}): {self.tail()}",
        )

    def tail(self) -> str:
        return json.dumps([e["event"] for e in self.events()][-20:])

    def finish(self, timeout_s: float = 90) -> int:
        self.done.touch()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise AssertionError(f"ftsup run did not finish in {timeout_s}s: {self.tail()}") from None
        return self.proc.returncode

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()


@pytest.fixture
def job_dir() -> Iterator[Path]:
    """A directory every user can traverse (pytest's own tmp is private to root), so that only
    ftsup's own permissions stand between another user and the channel."""
    path = Path(tempfile.mkdtemp(prefix="ftsup-hb-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def job(job_dir: Path) -> Iterator[Callable[..., Job]]:
    """Starts a Job in job_dir; whatever it left running is killed at the end."""
    started: list[Job] = []

    def start(*args: str, **kw: Any) -> Job:
        j = Job(job_dir, *args, **kw)
        started.append(j)
        return j

    yield start
    for j in started:
        j.kill()


def timed_out(j: Job) -> list[str]:
    return [e["reason"] for e in j.events() if e["event"].endswith("_timed_out")]


def flood(path: Path, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """A flood of malformed messages from a process outside the attempt (this test's child)."""
    return subprocess.Popen(
        [*BEATER, "flood", str(path), str(seconds), str(out)], env=dict(os.environ, PYTHONPATH=PYTHONPATH)
    )


# ---------------------------------------------------------------------- floods


def test_a_flood_from_inside_and_outside_the_attempt_kills_no_healthy_attempt_and_is_counted(job, job_dir):
    j = job("--steps", "1", "--flood-at", "10", "--flood-s", "2.5", "--flood-out", str(job_dir / "inside.json"))
    j.wait_for_step(10)
    outside = flood(j.run_dir / "heartbeat.sock", 2.5, job_dir / "outside.json")
    try:
        outside.wait(timeout=60)
        wait_for(lambda: (job_dir / "inside.json").exists(), 60, "the flood inside the attempt did not end")
        j.wait_for_step(j.step() + 10)  # still training after the flood
        dropped = {r: j.metric("ftsup_heartbeats_dropped_total", reason=r) for r in ("malformed", "foreign")}
    finally:
        kill_tree(outside.pid)
    sent = [json.loads((job_dir / f"{w}.json").read_text())["sent"] for w in ("inside", "outside")]
    assert (j.finish(), timed_out(j), len(j.events("workers_launched"))) == (0, [], 1)
    assert (min(sent) > 0, dropped["malformed"] > 0, dropped["foreign"] > 0) == (True, True, True), (sent, dropped)


def test_a_rank_stopped_during_a_flood_is_caught_within_its_timeout_plus_1s(job, job_dir):
    j = job(
        "--steps", "60", "--flood-at", "5", "--flood-s", "3", "--stop-at", "12", "--stop-mark", str(job_dir / "stopped")
    )
    assert j.finish(timeout_s=120) == 0, j.tail()
    (hang,) = j.events("heartbeat_timed_out")
    detected = datetime.fromisoformat(hang["timestamp"].replace("Z", "+00:00")).timestamp()
    stopped = float((job_dir / "stopped").read_text())
    assert (hang["rank"], detected - stopped <= hang["timeout_s"] + 1.0) == (0, True), (detected - stopped, hang)


# ---------------------------------------------------------------------- spoofing and other users


def test_a_beat_claiming_another_process_neither_reaches_the_journal_nor_gets_it_signalled(job, job_dir):
    j = job("--steps", "1")
    j.wait_for_step(5)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        beat = {
            "v": 2,
            "attempt": 1,
            "rank": 7,
            "local_rank": 7,
            "pid": victim.pid,
            "step": 3,
            "phase": "train",
            "t": time.time(),
            "mono": time.monotonic(),
        }
        path = str(j.run_dir / "heartbeat.sock")
        for kind in (socket.SOCK_SEQPACKET, socket.SOCK_DGRAM):  # whichever the supervisor listens on
            with socket.socket(socket.AF_UNIX, kind) as s:
                try:
                    s.connect(path)
                    s.send(json.dumps(beat).encode())
                except OSError:
                    pass
        j.wait_for_step(j.step() + 10)  # read by now: the channel is drained every tick
        journal = json.loads((j.tmp / "state" / "journal.json").read_text())
        rc = j.finish()
        alive = victim.poll() is None
    finally:
        kill_tree(victim.pid)
        victim.wait()
    assert (rc, victim.pid in journal["pids"], alive) == (0, False, True)


def test_a_rank_forging_beats_for_rank_5_and_step_10_to_the_12_is_never_waited_for_nor_believed(job):
    """A rank of a 2-rank job sends, from its own pid, a beat claiming rank 5 and one claiming step 10**12. Both are
    dropped and counted; the supervisor never waits for rank 5 (its learned timeout passes many times over while the
    job trains on) and step 10**12 becomes neither the job's step nor the goodput high-water mark."""
    j = job("--steps", "1", "--forge-at", "10")
    j.wait_for_step(10)

    def dropped() -> tuple[float, float]:
        return (
            j.metric("ftsup_heartbeats_dropped_total", reason="forged"),
            j.metric("ftsup_heartbeats_dropped_total", reason="ahead"),
        )

    wait_for(lambda: min(dropped()) >= 1, 60, lambda: f"the forged beats were not dropped: {dropped()}")
    timeout = j.metric("ftsup_heartbeat_timeout_seconds")
    at = j.step()
    j.wait_for_step(at + 3 * timeout / 0.05)  # three timeouts' worth of 0.05 s steps: rank 5 long silent by then
    ranks = sorted(r["rank"] for r in json.loads((j.tmp / "state" / "ranks.json").read_text())["ranks"])
    step = j.step()
    rc = j.finish()
    high_water = json.loads((j.tmp / "state" / "journal.json").read_text())["goodput"]["high_water_step"]
    assert (rc, timed_out(j), len(j.events("workers_launched")), ranks) == (0, [], 1, [0, 1]), j.tail()
    assert (step < 10**6, high_water < 10**6) == (True, True), (step, high_water)


def _nobody_python() -> str | None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    for exe in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        probe = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", exe, "-I", "-c", "0"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        if probe.returncode == 0:
            return exe
    return None


NOBODY_PROBE = r"""
import json, os, signal, socket, sys
run, pid = sys.argv[1], int(sys.argv[2])
def attempt(f):
    try:
        f()
        return "allowed"
    except PermissionError:
        return "denied"
    except OSError as e:
        return f"error {e.errno}"
def seqpacket():
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(run + "/heartbeat.sock")
def datagram():
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"{}", run + "/heartbeat.sock")
def control():
    with open(run + "/control.json", "w") as f:
        f.write('{"seq": 99, "action": "save", "stop": true}')
print(json.dumps({
    "job_dir": attempt(lambda: os.listdir(os.path.dirname(os.path.dirname(run)))),
    "run_dir": attempt(lambda: os.listdir(run)),
    "heartbeat_seqpacket": attempt(seqpacket),
    "heartbeat_datagram": attempt(datagram),
    "control_file": attempt(control),
    "journal": attempt(lambda: open(os.path.dirname(run) + "/journal.json").read()),
    "stop_signal": attempt(lambda: os.kill(pid, signal.SIGTERM)),
    "eviction_signal": attempt(lambda: os.kill(pid, signal.SIGUSR1)),
}))
"""


def test_another_local_user_can_neither_beat_nor_request_a_save_or_a_stop_nor_read_the_journal(job, job_dir):
    python = _nobody_python()
    if python is None:
        pytest.skip("needs root, setpriv and a python that user 65534 can run")
    j = job("--steps", "1", nproc=1, eviction={"signals": ["SIGUSR1"]})
    j.wait_for_step(5)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    argv = [*as_nobody, python, "-I", "-c", NOBODY_PROBE, str(j.run_dir), str(j.proc.pid)]
    probe = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(probe.stdout)
    j.wait_for_step(j.step() + 5)
    assert (j.finish(), j.events("save_requested"), j.events("stop_requested")) == (0, [], [])
    assert got == {"job_dir": "allowed", **dict.fromkeys(list(got)[1:], "denied")}  # the probe got that far


# ---------------------------------------------------------------------- stalls and long phases


def test_a_supervisor_stall_neither_inflates_the_learned_timeout_nor_makes_ranks_look_silent(job):
    j = job("--steps", "1", "--step-s", "0.05")
    j.wait_for_step(15)
    j.proc.send_signal(signal.SIGSTOP)  # the loop stalls (as on a slow checkpoint scan); the ranks go on
    try:
        time.sleep(3.0)  # the length of the injected stall, not a wait for something to happen
    finally:
        j.proc.send_signal(signal.SIGCONT)
    j.wait_for_step(j.step() + 20)
    timeout = j.metric("ftsup_heartbeat_timeout_seconds")
    assert (j.finish(), timed_out(j), timeout < 3.0) == (0, [], True), timeout


def test_a_long_eval_that_keeps_beating_is_not_a_hang(job):
    j = job("--steps", "40", "--eval-at", "20", "--eval-s", "6", heartbeat={"interval_s": 0.25})
    rc = j.finish(timeout_s=120)  # the beaters still stop at step 40: --until is already there
    assert (rc, timed_out(j), len(j.events("workers_launched"))) == (0, [], 1)
