"""The evidence a hang leaves behind, under `ftsup run` with two gloo DDP ranks of `tests/bin/hang_rank.py`: before
the hung attempt is stopped, every rank's stacks are captured and kept in an incident record that names the rank to
blame: one stopped by SIGSTOP, or one stuck in a Python loop while the other waits in DDP's all-reduce; with the stack
tool hanging or missing the capture ends within its bound, and the attempt is restarted all the same. The SIGSTOPped
rank's run also holds test_collective_waits.py's claim for a DDP job: its hang event blames rank 1, not rank 0 that
waits for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from ftsup.supervisor.cli.incidents import render
from ftsup.supervisor.state.incidents import Incident, Store
from tests.integration.test_collective_waits import FLOOR, HANGS, events, output, start
from tests.procs import BIN, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess


def hang(tmp_path: Path, how: str, *flags: str) -> subprocess.Popen[bytes]:
    """`hang_rank.py` under `ftsup run`: rank 1 hangs (`how`) at step 20 of attempt 1; attempt 2 trains on."""
    job = ["--", str(BIN / "hang_rank.py"), "--dir", str(tmp_path), "--steps", "100000", "--at", "20", "--how", how]
    return start(tmp_path, "--restart-backoff-initial-s", "0.1", *FLOOR, *flags, *job)


def incident_and_relaunch(tmp_path: Path, proc: subprocess.Popen[bytes]) -> Incident:
    """The hang's incident record, once the attempt after it launched; then an operator's stop (exit 6)."""
    wait_for(
        lambda: [e for e in events(tmp_path) if e["event"] == "workers_launched" and e["attempt"] == 2],
        90,
        lambda: f"no relaunch after the hang: {output(tmp_path)}",
    )
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 6, output(tmp_path)
    (recorded,) = [e for e in events(tmp_path) if e["event"] == "incident_recorded"]
    (state_dir,) = (tmp_path / ".ftsup").glob("*/")
    return Store(state_dir).read(recorded["id"])


def stopped_before_captured(tmp_path: Path) -> bool:
    """The capture came before the stop: `incident_recorded` precedes `workers_stopped` in the log."""
    names = [e["event"] for e in events(tmp_path)]
    return names.index("incident_recorded") < names.index("workers_stopped")


def pid_of(tmp_path: Path, rank: int) -> int | None:
    try:
        return int(json.loads((tmp_path / f"rank-{rank}.json").read_text())["pid"])
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return None


def frames(incident: Incident, rank: int) -> list[str]:
    (r,) = [r for r in incident.ranks if r.rank == rank]
    return [f for t in r.threads if t.main for f in t.frames]


def test_a_sigstopped_rank_1_is_named_by_the_incident_which_holds_rank_0_waiting_in_the_all_reduce(tmp_path: Path):
    proc = hang(tmp_path, "stop")
    try:
        incident = incident_and_relaunch(tmp_path, proc)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    by_rank = {r.rank: r for r in incident.ranks}
    told = (
        incident.trigger,
        incident.culprit,
        incident.culprit_why,
        sorted(by_rank),
        stopped_before_captured(tmp_path),
    )
    assert told == ("hang", 1, "stopped (SIGSTOP/state T)", [0, 1], True), incident
    (event,) = [e for e in events(tmp_path) if e["event"] in HANGS]  # rank 1 blamed, not rank 0 that waits for it
    blamed = (event["event"], event["rank"], event.get("state"), event.get("waiting"), event["reason"].split(",")[0])
    assert blamed == ("heartbeat_timed_out", 1, "T", [0], "rank 1 stopped (SIGSTOP/state T)"), event
    assert (by_rank[0].state, by_rank[0].collective, by_rank[1].state, by_rank[1].tool) == ("S", True, "T", "pystack")
    assert any("c10d::Reducer::finalize_backward" in f for f in frames(incident, 0)), frames(incident, 0)
    assert any(f.endswith("os.kill(os.getpid(), signal.SIGSTOP)") for f in frames(incident, 1)), frames(incident, 1)
    shown = render(incident)  # `ftsup incidents show ID`: the last beats and the last lines too
    beat = f"  rank 1 (pid {by_rank[1].pid}): last beat step 20 ("
    shows = ([ln for ln in shown if ln.startswith(beat)] != [], "  [rank1] rank 1 hangs at step 20 (stop)" in shown)
    assert shows == (True, True), "\n".join(shown)


def test_a_rank_spinning_in_python_is_named_though_the_heartbeats_alone_could_blame_either(tmp_path: Path):
    proc = hang(tmp_path, "spin")
    try:
        nccl = wait_for(lambda: next((tmp_path / ".ftsup").glob("*/nccl/"), None), 60, lambda: output(tmp_path))
        (nccl / "a0001-rank_1").write_bytes(b"\x80a planted flight record")  # as torch's NCCL group would dump it
        rank_pid = wait_for(lambda: pid_of(tmp_path, 1), 60, lambda: f"rank 1 never stepped: {output(tmp_path)}")
        environ = psutil.Process(rank_pid).environ()
        incident = incident_and_relaunch(tmp_path, proc)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    by_rank = {r.rank: r for r in incident.ranks}
    told = (incident.culprit, incident.culprit_why, [(d.rank, d.bytes) for d in incident.nccl], sorted(by_rank))
    assert told == (1, "not inside a collective, while rank 0 is", [(1, 24)], [0, 1]), incident
    assert (by_rank[0].collective, by_rank[1].collective) == (True, False), incident
    assert any("c10d::Reducer::finalize_backward" in f for f in frames(incident, 0)), frames(incident, 0)
    # Either line of its loop: a sample may catch the jump back to `while True:` as well as the addition.
    spinning = ("n += 1", "while True:  # the hang a stack must show: a rank busy in Python, not in a collective")
    assert any(f.startswith("spin (") and f.endswith(spinning) for f in frames(incident, 1)), frames(incident, 1)
    assert (environ["TORCH_FR_BUFFER_SIZE"], environ["TORCH_FR_DEBUG_INFO_PIPE_FILE"]) == (
        "2000",
        str(nccl / "a0001-rank_"),
    )


def stuck_tools() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if "stuck_tool" in " ".join(p.info["cmdline"] or ())]


def test_a_stack_tool_that_hangs_is_stopped_at_the_bound_and_the_attempt_is_restarted(tmp_path: Path):
    tools = f"forensics.tools=[{BIN / 'stuck_tool' / 'pystack'}]"
    proc = hang(tmp_path, "stop", "--set", tools, "--set", "forensics.timeout_s=1.5")
    try:
        incident = incident_and_relaunch(tmp_path, proc)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    problems = {r.rank: r.problems[0].split(" within")[0] for r in incident.ranks}
    kernel = [f for r in incident.ranks for t in r.threads for f in t.frames if f.startswith("[kernel] ")]
    assert (incident.culprit, (incident.duration_s or 0.0) <= 1.5, problems) == (
        1,
        True,
        {0: "pystack: no answer", 1: "pystack: no answer"},
    ), incident
    assert (kernel != [], stuck_tools()) == (True, [])


def test_with_the_stack_tool_missing_the_kernels_view_is_kept_and_the_attempt_is_restarted(tmp_path: Path):
    proc = hang(tmp_path, "stop", "--set", "forensics.tools=[/nowhere/pystack]")
    try:
        incident = incident_and_relaunch(tmp_path, proc)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    states = {r.rank: (r.state, r.tool, r.problems[0].split(":")[1].strip()) for r in incident.ranks}
    assert (incident.culprit, (incident.duration_s or 0.0) <= 3.0, states) == (
        1,
        True,
        {
            0: ("S", None, "not found (install ftsup[forensics], or set forensics.tools)"),
            1: ("T", None, "not found (install ftsup[forensics], or set forensics.tools)"),
        },
    ), incident
    assert os.path.exists(Store(next((tmp_path / ".ftsup").glob("*/"))).path(incident.id))
