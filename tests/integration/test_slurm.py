"""A real Slurm on this machine: `deploy/slurm/ftsup.sbatch` evicted, requeued, resumed, bitwise.

The fixture starts munged, slurmctld and slurmd as this user from a slurm.conf in the test's temporary directory
(one node, no cgroups, ports, directories and a munge socket of its own; skipped, saying why, without slurm-wlm and
munge). The test submits the sbatch script for the reference trainer (2 ranks), sends `scancel --signal=USR1
--batch` mid-run (what `--signal=B:USR1@120` does before a time limit), and checks: the job is requeued, the newest
checkpoint is an emergency one of the step the ranks were on, and the requeued run completes with a loss log
bitwise equal to an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import yaml

from ftsup.store import layout
from tests.procs import PYTHONPATH, REPO, free_port, run, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

SBATCH = REPO / "deploy" / "slurm" / "ftsup.sbatch"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo", "srun")
STEPS = 30
NOTICE_AT = 8
SMALL_MODEL = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "32", "--corpus-bytes", "200000"]
TRAINER = ["-m", "ftsup.trainer.examples.gpt", "--steps", str(STEPS), "--ckpt-every", "100", *SMALL_MODEL]
TRAINER += ["--min-step-s", "0.2"]
# Job states from which a job never runs again by itself.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@dataclass
class Cluster:
    """A running single-node Slurm; `env` reaches it (SLURM_CONF) and marks every process it starts."""

    root: Path
    node: str
    env: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def cmd(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}\n{self.logs()}")
        return r.stdout

    def job(self, job_id: str) -> dict[str, str]:
        line = self.cmd("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((self.root / "log").glob("*"))
        )


# cred_expire=10: a requeued job waits cred_expire + 1 seconds (120 s by default) for its begin time. Bringing it
# forward with `scontrol update StartTime=now` instead races slurmd still ending the first run, which refuses the
# relaunch ("Job N already killed, do not launch batch job") and the job FAILS.
def slurm_conf(root: Path, node_line: str, ctld_port: int, slurmd_port: int) -> str:
    node = node_line.split()[0].partition("=")[2]
    return f"""\
ClusterName=ftsuptest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=10
InactiveLimit=0
MailProg=/bin/true
{node_line} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def start_daemon(cluster: Cluster, name: str, *argv: str) -> subprocess.Popen:
    out = open(cluster.root / "log" / f"{name}.out", "wb")  # noqa: SIM115  # closed with the process
    proc = subprocess.Popen(argv, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    out.close()  # the child holds its own copy
    cluster.daemons.append(proc)
    return proc


def ours(marker: str) -> list[psutil.Process]:
    """Every process that carries this cluster's marker: daemons, slurmstepd, job scripts, ranks."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("FTSUP_TEST_SLURM") == marker:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def teardown(cluster: Cluster) -> None:
    # Cancel jobs first, while slurmd can still end their steps the ordinary way.
    try:
        ids = cluster.cmd("squeue", "-h", "-o", "%i", check=False, timeout=10).split()
        if ids:
            cluster.cmd("scancel", *ids, check=False, timeout=10)
            wait_for(
                lambda: not cluster.cmd("squeue", "-h", "-o", "%i", check=False, timeout=10).strip(),
                30,
                "jobs still listed 30 s after scancel",
            )
    except (AssertionError, subprocess.TimeoutExpired, OSError):
        pass  # the daemons are stopped below whatever happened here
    for proc in reversed(cluster.daemons):  # slurmd, slurmctld, then munged
        proc.send_signal(signal.SIGTERM)
    for proc in reversed(cluster.daemons):
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    left = ours(cluster.env["FTSUP_TEST_SLURM"])
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    assert [p.pid for p in ours(cluster.env["FTSUP_TEST_SLURM"])] == []


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[Cluster]:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        reason = f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
        warnings.warn(f"skipped: {reason}", stacklevel=1)  # shown in the summary even under -q
        pytest.skip(reason)
    if os.geteuid() != 0:
        pytest.skip("a private Slurm with SlurmUser=root needs root")
    root = tmp_path / "slurm"
    for sub in ("munge", "munge-key", "state", "spool", "log"):
        (root / sub).mkdir(parents=True)
    (root / "munge-key").chmod(0o700)
    key = root / "munge-key" / "munge.key"
    key.write_bytes(os.urandom(128))  # what `mungekey -c` writes: 1024 random bits
    key.chmod(0o600)
    node_line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, node_line, free_port(), free_port()))
    env = dict(os.environ, SLURM_CONF=str(conf), FTSUP_TEST_SLURM=str(root))
    cluster = Cluster(root, node_line.split()[0].partition("=")[2], env)
    try:
        sock = root / "munge" / "munge.socket"
        munge = [f"--key-file={key}", f"--socket={sock}", f"--pid-file={root}/munge/munged.pid"]
        munge += [f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/seed"]
        start_daemon(cluster, "munged", "munged", "--foreground", "--force", *munge)
        wait_for(sock.exists, 20, lambda: f"munged made no socket\n{cluster.logs()}")
        start_daemon(cluster, "slurmctld", "slurmctld", "-D", "-i", "-f", str(conf))
        start_daemon(cluster, "slurmd", "slurmd", "-D", "-f", str(conf), "-N", cluster.node)
        wait_for(
            lambda: cluster.cmd("sinfo", "-h", "-n", cluster.node, "-o", "%T", check=False).strip() == "idle",
            60,
            lambda: f"the node never became idle\n{cluster.logs()}",
        )
        yield cluster
    finally:
        teardown(cluster)


def last_per_step(log: Path) -> dict[int, str]:
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return {j["step"]: j["loss_hex"] for j in lines}


def test_usr1_to_the_batch_shell_saves_requeues_and_the_requeued_job_finishes_bitwise(slurm: Cluster, tmp_path):
    ref_log = tmp_path / "ref.jsonl"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    argv += [*TRAINER, "--loss-log", str(ref_log), "--ckpt-dir", str(tmp_path / "ref-ckpt")]
    ref = run(argv, timeout=120)
    assert ref.returncode == 0, ref.output[-3000:]
    reference = last_per_step(ref_log)

    loss, ckpt, state = tmp_path / "loss.jsonl", tmp_path / "ckpt", tmp_path / "state"
    job = tmp_path / "job.yaml"
    cfg = {
        "job": {
            "command": [sys.executable, *TRAINER, "--loss-log", str(loss)],
            "workdir": str(REPO),
            "state_dir": str(state),
            "env": {"PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
        },
        "launch": {"nproc_per_node": 2},
        "checkpoint": {"dir": str(ckpt)},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
        "eviction": {"save_margin_s": 2},
    }
    job.write_text(yaml.safe_dump(cfg))
    (tmp_path / "tmp").mkdir()
    slurm.env.update(
        PYTHONPATH=PYTHONPATH,
        OMP_NUM_THREADS="1",
        FTSUP_PYTHON=sys.executable,
        FTSUP_RDZV_PORT=str(free_port()),
        TMPDIR=str(tmp_path / "tmp"),
    )
    out = tmp_path / "slurm-job.out"
    submitted = slurm.cmd(
        "sbatch", "--parsable", "--nodes=1", f"--output={out}", f"--chdir={tmp_path}", str(SBATCH), str(job)
    )
    job_id = submitted.strip().partition(";")[0]

    def output() -> str:
        return f"{out.read_text()[-6000:] if out.exists() else '(no job output)'}\n{slurm.logs()}"

    def running_at(step: int) -> bool:
        state_now = slurm.job(job_id)["JobState"]
        assert state_now not in ENDED, f"job {job_id} ended early ({state_now})\n{output()}"
        steps = last_per_step(loss)
        return bool(steps) and max(steps) >= step

    wait_for(lambda: running_at(NOTICE_AT), 120, lambda: f"step {NOTICE_AT} never logged\n{output()}")
    slurm.cmd("scancel", "--signal=USR1", "--batch", job_id)
    wait_for(lambda: slurm.job(job_id)["Restarts"] == "1", 60, lambda: f"job {job_id} was not requeued\n{output()}")

    saved_at = max(last_per_step(loss))
    latest = layout.latest_consistent(ckpt, deep=True)
    assert latest is not None, output()
    assert (latest.step, latest.kind) == (saved_at, "emergency"), output()
    assert json.loads((state / "journal.json").read_text())["status"] == "evicted"
    assert "SIGUSR1 sent to supervisor" in out.read_text()  # to the supervisor alone: the ranks lived to save

    final = wait_for(
        lambda: s if (s := slurm.job(job_id))["JobState"] in ENDED else None,
        120,
        lambda: f"the requeued job {job_id} did not finish\n{output()}",
    )
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "1"), output()
    events = [json.loads(x) for x in (state / "logs" / "supervisor.jsonl").read_text().splitlines()]
    launches = [e["resume_step"] for e in events if e["event"] == "workers_launched"]
    assert launches == [None, saved_at], output()
    assert last_per_step(loss) == reference
