"""The deploy files do what their comments promise, without a cluster or an init system.

- `deploy/systemd/ftsup@.service` passes `systemd-analyze verify`, its exit-status lists match
  `ftsup.supervisor.policy.machine`, and `ftsup run` speaks the sd_notify protocol the unit relies on
  (READY=1; on SIGTERM, EXTEND_TIMEOUT_USEC while it saves, then exit 5).
- `deploy/slurm/ftsup.sbatch` runs against stand-ins for `srun` and `scontrol` (two fake
  nodes on this machine) and a stand-in supervisor: per-node configs, USR1 forwarding to each
  node's supervisor, one requeue after exit 5, and refusals before anything starts.
  tests/integration/test_slurm.py runs the same script under a real Slurm.
"""

from __future__ import annotations

import configparser
import os
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from ftsup.store import layout
from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.policy import machine as policy
from tests.procs import PYTHONPATH, REPO, kill_tree, wait_for

UNIT = REPO / "deploy" / "systemd" / "ftsup@.service"
SBATCH = REPO / "deploy" / "slurm" / "ftsup.sbatch"


def skip(reason: str) -> None:
    warnings.warn(f"skipped: {reason}", stacklevel=2)  # shown in the summary even under -q
    pytest.skip(reason)


# --------------------------------------------------------------------------- systemd


def unit_service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser["Service"]


def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        skip("systemd-analyze is not installed (apt-get install systemd)")
    ftsup = Path(sys.executable).with_name("ftsup")
    # verify checks that ExecStart's program exists: point it at this checkout's ftsup.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/ftsup/.venv/bin/ftsup", str(ftsup)))
    r = subprocess.run(
        [tool, "verify", str(tmp_path / "ftsup@job.service")], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


def test_the_unit_stops_the_supervisor_alone_and_its_exit_statuses_match_the_policy():
    svc = unit_service()
    got = {key: svc[key] for key in ("Type", "KillMode", "Restart", "SuccessExitStatus", "RestartPreventExitStatus")}
    assert got == {
        "Type": "notify",
        "KillMode": "mixed",
        "Restart": "on-failure",
        "SuccessExitStatus": f"{policy.EXIT_EVICTED} {policy.EXIT_STOPPED}",
        # 7: an anomaly escalated (docs/incidents.md); 8: evicted, the emergency save failed; 9: finished, the final
        # checkpoint not durable
        "RestartPreventExitStatus": (
            f"{policy.EXIT_CONFIG} {policy.EXIT_ANOMALY} {policy.EXIT_SAVE_LOST} {policy.EXIT_NOT_DURABLE}"
        ),
    }


def test_ftsup_run_sends_ready_then_extends_the_stop_timeout_on_sigterm_and_exits_5(tmp_path):
    """What Type=notify, KillMode=mixed and SuccessExitStatus=5 rely on, against a fake NOTIFY_SOCKET."""
    loss = tmp_path / "loss.jsonl"
    command = [sys.executable, "-m", "ftsup.trainer.examples.gpt", "--steps", "200", "--ckpt-every", "100"]
    command += ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--corpus-bytes", "50000"]
    command += ["--min-step-s", "0.1", "--loss-log", str(loss)]
    cfg = {
        "job": {
            "command": command,
            "workdir": str(REPO),
            "state_dir": str(tmp_path / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "restart": {"stop_grace_s": 3},
        "eviction": {"save_margin_s": 2},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(cfg))
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(sock_path))
        sock.settimeout(0.2)
        env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", NOTIFY_SOCKET=str(sock_path))
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        messages: list[str] = []

        def receive() -> None:
            try:
                messages.extend(sock.recv(4096).decode().splitlines())
            except TimeoutError:
                pass

        try:
            wait_for(lambda: receive() or "READY=1" in messages, 60, f"no READY=1; got {messages}")
            wait_for(lambda: loss.exists() and len(loss.read_text().splitlines()) >= 3, 120, "no training step")
            proc.send_signal(signal.SIGTERM)  # what `systemctl stop` does with KillMode=mixed
            code = proc.wait(timeout=60)
        finally:
            kill_tree(proc.pid)
        sock.setblocking(False)  # the rest is queued in the socket already
        while True:
            try:
                messages.extend(sock.recv(4096).decode().splitlines())
            except BlockingIOError:
                break
    extends = [m for m in messages if m.startswith("EXTEND_TIMEOUT_USEC=")]
    assert (code, messages[0], len(extends), messages[-1]) == (policy.EXIT_EVICTED, "READY=1", 1, "STOPPING=1")
    assert int(extends[0].partition("=")[2]) >= 30_000_000  # the default 30 s notice deadline at least
    latest = layout.latest_consistent(tmp_path / "ckpt")
    assert latest is not None and latest.kind == "emergency"


# --------------------------------------------------------------------------- the sbatch script, faked Slurm

FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/calls"
case "$1 $2" in
  "show hostnames") for n in $FAKE_NODES; do echo "$n"; done ;;
  "requeue "*) ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""

# Runs the command once per fake node (SLURMD_NODENAME set), all at once; exits with the highest
# status, as srun does.
FAKE_SRUN = """#!/bin/bash
opts=()
while [[ $1 == -* ]]; do opts+=("$1"); shift; done
echo "srun ${opts[*]}" >> "$FAKE_DIR/calls"
pids=()
for n in $FAKE_NODES; do
  SLURMD_NODENAME=$n "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || { s=$?; (( s > rc )) && rc=$s; }; done
exit $rc
"""

# Stands in for the interpreter: `-m ftsup.supervisor.cli run --config X` becomes a fake supervisor
# (handles USR1, records what it got, exits $FAKE_EXIT); anything else goes to the real Python.
FAKE_PYTHON = """#!/bin/bash
if [[ $1 == -m && $2 == ftsup.supervisor.cli ]]; then
  exec {python} {fake_supervisor} "$5"
fi
exec {python} "$@"
"""

FAKE_SUPERVISOR = """
import os, pathlib, signal, sys, time
out = pathlib.Path(os.environ["FAKE_DIR"]) / os.environ["SLURMD_NODENAME"]
out.mkdir()
(out / "config.yaml").write_text(pathlib.Path(sys.argv[1]).read_text())
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append("SIGUSR1"))
(out / "pid").write_text(str(os.getpid()))
deadline = time.monotonic() + float(os.environ.get("FAKE_RUN_S", "60"))
while time.monotonic() < deadline and not got:
    time.sleep(0.02)
(out / "signals").write_text(" ".join(got))
sys.exit(int(os.environ["FAKE_EXIT"]))
"""


def fake_slurm(tmp: Path) -> dict[str, str]:
    fakes = tmp / "bin"
    fakes.mkdir()
    (tmp / "fake").mkdir()
    (tmp / "fake_supervisor.py").write_text(FAKE_SUPERVISOR)
    scripts = {
        "scontrol": FAKE_SCONTROL,
        "srun": FAKE_SRUN,
        "python": FAKE_PYTHON.format(python=sys.executable, fake_supervisor=tmp / "fake_supervisor.py"),
    }
    for name, text in scripts.items():
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{fakes}:{os.environ['PATH']}",
        PYTHONPATH=PYTHONPATH,
        FAKE_DIR=str(tmp / "fake"),
        FAKE_NODES="n1 n2",
        FAKE_EXIT="5",
        FTSUP_PYTHON=str(fakes / "python"),
        TMPDIR=str(tmp),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_JOB_NUM_NODES="2",
    )


def job_config(tmp: Path, **launch) -> Path:
    cfg = {
        "job": {"command": ["python", "train.py"], "run_id": "gpt"},
        "launch": {"nproc_per_node": 2, "nnodes": "1:2", "rdzv_endpoint": "localhost:1", **launch},
        "checkpoint": {"dir": "ckpt"},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def calls(tmp: Path) -> list[str]:
    path = tmp / "fake" / "calls"
    return path.read_text().splitlines() if path.exists() else []


def start_sbatch(tmp: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(SBATCH), *args],
        env=env,
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_usr1_to_the_batch_shell_reaches_every_node_supervisor_and_exit_5_requeues_once(tmp_path):
    env = fake_slurm(tmp_path)
    job = job_config(tmp_path)
    proc = start_sbatch(tmp_path, env, "job.yaml")
    try:
        pids = [tmp_path / "fake" / n / "pid" for n in ("n1", "n2")]
        wait_for(lambda: all(p.exists() for p in pids), 60, "the fake supervisors never started")
        os.kill(proc.pid, signal.SIGUSR1)  # what `scancel --signal=USR1 --batch` and --signal=B:USR1 do
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    got = {n: (tmp_path / "fake" / n / "signals").read_text() for n in ("n1", "n2")}
    assert (proc.returncode, got) == (policy.EXIT_EVICTED, {"n1": "SIGUSR1", "n2": "SIGUSR1"}), out
    assert [c for c in calls(tmp_path) if c.startswith("scontrol requeue")] == ["scontrol requeue 4242"]
    # Each supervisor recorded its own pid where the forwarding step looks for it.
    assert sorted(p.name for p in tmp_path.glob("ftsup-slurm-4242-*.pid")) == [
        "ftsup-slurm-4242-n1.pid",
        "ftsup-slurm-4242-n2.pid",
    ]
    original = load_config(job)
    for node in ("n1", "n2"):
        copy = load_config(tmp_path / "fake" / node / "config.yaml")
        assert (copy.launch.node_id, copy.launch.rdzv_endpoint, copy.eviction.requeue_command) == (
            node,
            "n1:24242",  # the first node, port 20000 + 4242 % 10000
            ("true",),  # the batch script requeues, once
        )
        assert (copy.job.run_id, copy.launch.rdzv_id, copy.checkpoint.dir, copy.job.workdir, copy.job.state_dir) == (
            original.job.run_id,
            original.launch.rdzv_id,
            original.checkpoint.dir,
            original.job.workdir,
            tmp_path / ".ftsup" / node,
        )


def test_a_job_that_ends_without_eviction_is_not_requeued_and_keeps_its_exit_status(tmp_path):
    env = dict(fake_slurm(tmp_path), FAKE_EXIT="0", FAKE_RUN_S="0")
    job_config(tmp_path)
    proc = start_sbatch(tmp_path, env, "job.yaml")
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    assert (proc.returncode, [c.split()[1] for c in calls(tmp_path) if c.startswith("scontrol")]) == (
        0,
        ["show"],
    ), out


def test_a_config_with_its_own_requeue_command_keeps_it_and_the_script_does_not_requeue(tmp_path):
    env = dict(fake_slurm(tmp_path), FAKE_RUN_S="0")
    job = job_config(tmp_path)
    cfg = yaml.safe_load(job.read_text())
    cfg["eviction"] = {"requeue_command": ["my-requeue", "now"]}
    job.write_text(yaml.safe_dump(cfg))
    proc = start_sbatch(tmp_path, env, "job.yaml")
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    copy = load_config(tmp_path / "fake" / "n1" / "config.yaml")
    assert (proc.returncode, copy.eviction.requeue_command) == (5, ("my-requeue", "now")), out
    assert [c for c in calls(tmp_path) if c.startswith("scontrol requeue")] == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"launch": {"nnodes": "1"}}, "launch.nnodes is '1' but Slurm allocated 2 node(s)"),
        ({"eviction": {"signals": ["SIGTERM"]}}, "eviction.signals must include SIGUSR1"),
        ({"launch": {"nproc_per_node": "two"}}, "launch.nproc_per_node"),
    ],
)
def test_a_config_that_cannot_run_under_the_script_exits_2_before_srun(tmp_path, change, expected):
    env = fake_slurm(tmp_path)
    job = job_config(tmp_path)
    cfg = yaml.safe_load(job.read_text())
    for section, values in change.items():
        cfg.setdefault(section, {}).update(values)
    job.write_text(yaml.safe_dump(cfg))
    proc = start_sbatch(tmp_path, env, "job.yaml")
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    assert (proc.returncode, expected in out, [c for c in calls(tmp_path) if c.startswith("srun")]) == (
        2,
        True,
        [],
    ), out


def test_the_script_asks_slurm_for_the_batch_signal_requeue_and_one_task_per_node():
    directives = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert {"--ntasks-per-node=1", "--requeue", "--open-mode=append"} <= set(directives)
    assert [d for d in directives if d.startswith("--signal=")] == ["--signal=B:USR1@120"]
