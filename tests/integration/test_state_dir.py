"""`ftsup run` and its state directory: one supervisor per directory, trusted only when it is
ours, nothing followed through a planted link, no pid signalled because a file or a datagram
names it, and nothing left for git to show. Real supervisor, torchrun and reference trainer.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from ftsup.protocol import Phase, encode_beat
from tests.procs import PYTHONPATH, kill_tree, run, wait_for

pytestmark = pytest.mark.multiprocess

NODE = "n1"
NOBODY = 65534


def trainer(tmp: Path, steps: int, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "ftsup.trainer.examples.gpt", "--steps", str(steps), "--ckpt-every", "1000"]
    argv += ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--corpus-bytes", "50000"]
    return [*argv, "--loss-log", str(tmp / "loss.jsonl"), *extra]


def write_job(where: Path, tmp: Path, *, steps: int = 2, state_dir: Path | None = None, **job: Any) -> Path:
    cfg: dict[str, Any] = {
        "job": {
            "command": trainer(tmp, steps, "--min-step-s", "0.05"),
            "run_id": "sd-test",
            "env": {"PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
            **job,
        },
        "launch": {"nproc_per_node": 1, "node_id": NODE},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
    }
    if state_dir is not None:
        cfg["job"]["state_dir"] = str(state_dir)
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ftsup(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return run([sys.executable, "-m", "ftsup.supervisor.cli", *args], env=env, timeout=timeout)


def start(job: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        env={**os.environ, "PYTHONPATH": PYTHONPATH, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def events(state: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (state / "logs" / "supervisor.jsonl").read_text().splitlines()]


def journal(state: Path) -> dict[str, Any] | None:
    try:
        return json.loads((state / "journal.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this user that is no part of any job: nothing may signal it."""
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait(timeout=10)


@pytest.fixture
def supervisor_procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    out: list[subprocess.Popen[bytes]] = []
    yield out
    for p in out:
        kill_tree(p.pid)
        p.wait(timeout=10)


def alive(p: subprocess.Popen[bytes]) -> bool:
    return p.poll() is None


# --------------------------------------------------------------------------- single instance


def test_a_second_supervisor_of_the_same_job_exits_2_naming_the_first_and_signals_nothing(tmp_path, supervisor_procs):
    job = write_job(tmp_path, tmp_path, steps=2000)
    state = tmp_path / ".ftsup" / NODE
    first = start(job)
    supervisor_procs.append(first)
    rec = wait_for(lambda: (j := journal(state)) and j["status"] == "running" and j["pids"] and j, 60, "no attempt")
    torchrun = psutil.Process(rec["pids"][0])
    r = ftsup("run", "--config", str(job), timeout=60)
    lines = r.output.strip().splitlines()
    assert (r.returncode, len(lines)) == (2, 1), r.output
    assert lines[0].startswith(f"ftsup: error: another ftsup run (pid {first.pid})")
    assert torchrun.is_running() and alive(first)
    assert [e["event"] for e in events(state)].count("supervisor_started") == 1  # the second one logged nothing
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=60) == 6


# --------------------------------------------------------------------------- whose directory it is


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A job directory that every user can write (and reach: pytest's own tmp dirs are private)."""
    path = Path(tempfile.mkdtemp(prefix="ftsup-shared-", dir="/tmp"))
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_state_dir_planted_by_another_user_is_refused_and_nothing_is_signalled_or_written(shared_dir, victim):
    owned = shared_dir / "root-owned.log"  # a file of the supervisor's user that the planted links point at
    owned.write_text("keep\n")
    os.chmod(owned, 0o644)
    state = shared_dir / ".ftsup" / NODE
    plant = (
        "import json, os, sys, time\n"
        "state, victim, owned = sys.argv[1], int(sys.argv[2]), sys.argv[3]\n"
        "os.makedirs(state + '/logs'); os.makedirs(state + '/run')\n"
        "json.dump({'run_id': 'sd-test', 'node_id': 'n1', 'supervisor_pid': 1, 'attempt': 1, 'pids': [victim],\n"
        "           'attempt_started_unix': 1.0, 'status': 'running', 'updated_unix': time.time() + 1000},\n"
        "          open(state + '/journal.json', 'w'))\n"
        "os.symlink(owned, state + '/logs/supervisor.jsonl')\n"
        "os.symlink(owned, state + '/run/.control.json.tmp')\n"
        "for d in (state, state + '/logs', state + '/run', os.path.dirname(state)): os.chmod(d, 0o777)\n"
    )
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    planting = [sys.executable, "-c", plant, str(state), str(victim.pid), str(owned)]
    subprocess.run([*as_nobody, *planting], check=True, timeout=30)
    job = write_job(shared_dir, shared_dir)
    r = ftsup("run", "--config", str(job), timeout=60)
    lines = r.output.strip().splitlines()
    assert (r.returncode, len(lines)) == (2, 1), r.output
    assert "job.state_dir" in lines[0] and f"uid {NOBODY}" in lines[0]
    assert (alive(victim), owned.read_text(), (shared_dir / "loss.jsonl").exists()) == (True, "keep\n", False)


def test_a_log_file_planted_as_a_link_is_never_written_through(tmp_path):
    owned = tmp_path / "elsewhere.log"
    owned.write_text("keep\n")
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True, mode=0o700)
    (state / "logs" / "supervisor.jsonl").symlink_to(owned)
    r = ftsup("run", "--config", str(write_job(tmp_path, tmp_path, state_dir=state)), timeout=60)
    assert r.returncode != 0 and "supervisor.jsonl" in r.output
    assert (owned.read_text(), (tmp_path / "loss.jsonl").exists()) == ("keep\n", False)


def test_a_control_file_temporary_planted_as_a_link_is_never_written_through(tmp_path, supervisor_procs):
    owned = tmp_path / "elsewhere.json"
    owned.write_text("keep")
    state = tmp_path / "state"
    (state / "run").mkdir(parents=True, mode=0o700)
    (state / "run" / ".control.json.tmp").symlink_to(owned)
    job = write_job(tmp_path, tmp_path, steps=2000, state_dir=state)
    sup = start(job)
    supervisor_procs.append(sup)
    loss = tmp_path / "loss.jsonl"
    wait_for(lambda: loss.exists() and loss.read_text(), 120, "no training step")
    sup.send_signal(signal.SIGTERM)  # an eviction notice: the supervisor writes a save request
    assert sup.wait(timeout=90) == 5
    assert owned.read_text() == "keep"


# --------------------------------------------------------------------------- pids named from outside


def plant_journal(state: Path, **fields: Any) -> None:
    state.mkdir(parents=True, mode=0o700)
    rec = {
        "run_id": "sd-test",
        "node_id": NODE,
        "supervisor_pid": 1,
        "attempt": 3,
        "status": "running",
        "attempt_started_unix": time.time() - 5,
        "updated_unix": time.time() + 1000,
        **fields,
    }
    (state / "journal.json").write_text(json.dumps(rec))


def test_a_journal_pid_that_is_not_a_process_of_the_attempt_is_never_signalled(tmp_path, victim):
    state = tmp_path / "state"
    plant_journal(state, pids=[victim.pid], attempt_started_unix=1.0)
    r = ftsup("run", "--config", str(write_job(tmp_path, tmp_path, state_dir=state)))
    assert r.returncode == 0, r.output[-3000:]
    assert alive(victim)
    assert "leftovers_stopped" not in [e["event"] for e in events(state)]


def test_a_process_carrying_the_journaled_attempts_mark_is_stopped_before_the_next_attempt(tmp_path):
    state = tmp_path / "state"
    plant_journal(state, pids=[])
    env = {**os.environ, "FTSUP_RUN_ID": "sd-test", "FTSUP_NODE_ID": NODE, "FTSUP_ATTEMPT": "3"}
    left = subprocess.Popen(["sleep", "300"], env=env)  # a rank of attempt 3 that outlived its supervisor
    try:
        r = ftsup("run", "--config", str(write_job(tmp_path, tmp_path, state_dir=state)))
        assert r.returncode == 0, r.output[-3000:]
        assert left.wait(timeout=10) == -signal.SIGTERM
    finally:
        left.kill()
        left.wait(timeout=10)
    evs = events(state)
    stopped = [e for e in evs if e["event"] == "leftovers_stopped"]
    assert [(e["attempt"], e["pids"]) for e in stopped] == [(3, [left.pid])]
    assert [e["attempt"] for e in evs if e["event"] == "workers_launched"] == [4]


def test_a_pid_claimed_in_a_heartbeat_is_never_signalled(tmp_path, supervisor_procs):
    state = tmp_path / "state"
    job = write_job(tmp_path, tmp_path, steps=2000, state_dir=state)
    sup = start(job)
    supervisor_procs.append(sup)
    loss = tmp_path / "loss.jsonl"
    wait_for(lambda: loss.exists() and loss.read_text(), 120, "no training step")
    victim = subprocess.Popen(["sleep", "300"])  # this user's, started while the attempt runs, no part of it
    supervisor_procs.append(victim)
    beat = encode_beat(
        attempt=1, rank=0, local_rank=7, pid=victim.pid, step=1, phase=Phase.TRAIN, t=time.time(), mono=time.monotonic()
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:  # the channel's own kind of socket
        s.connect(str(state / "run" / "heartbeat.sock"))
        s.send(beat)
    sup.send_signal(signal.SIGTERM)  # the attempt is stopped: only its own processes may be signalled
    assert sup.wait(timeout=90) == 5
    assert alive(victim)


# --------------------------------------------------------------------------- where the state goes


def test_a_run_from_a_git_repository_leaves_nothing_for_git_to_show(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=30)
    job = write_job(repo, tmp_path)  # workdir: the config's directory, the repository
    r = ftsup("run", "--config", str(job))
    assert r.returncode == 0, r.output[-3000:]
    shown = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.splitlines()
    assert shown == ["?? job.yaml"]
    status = ftsup("status", "--config", str(job), "--json")
    assert json.loads(status.output)["journal"]["status"] == "succeeded"


def test_under_systemd_the_state_goes_to_its_directories_and_status_finds_it(tmp_path):
    sd_state, sd_run = tmp_path / "var-lib", tmp_path / "run"
    for d in (sd_state, sd_run):
        d.mkdir(mode=0o700)  # systemd creates them, owned by the unit's user
    work = tmp_path / "etc"
    work.mkdir()
    job = write_job(work, tmp_path)
    env = {"STATE_DIRECTORY": str(sd_state), "RUNTIME_DIRECTORY": str(sd_run)}
    r = ftsup("run", "--config", str(job), env=env)
    assert r.returncode == 0, r.output[-3000:]
    assert (sorted(p.name for p in work.iterdir()), (sd_state / "journal.json").exists()) == (["job.yaml"], True)
    assert list(sd_run.iterdir()) == []  # its files are gone, the directory is systemd's
    status = ftsup("status", "--config", str(job), "--json", env=env)
    assert json.loads(status.output)["journal"]["status"] == "succeeded"
