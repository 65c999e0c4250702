"""The spare torchrun agent (`run/warmagent.py`, `ftsup.warmrun`) on its own: real interpreters, real torchrun.

A spare parked for attempt N runs attempt N's torchrun with the environment, working directory and log file it is
handed, as the pid it was parked as; anything it cannot be used for stops it and leaves the caller to start cold;
it dies with the process that parked it, and exits at once when let go.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO

import psutil
import pytest

from ftsup import procs, warmrun
from ftsup.supervisor.config.job import parse_config
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.run import launcher, warmagent, workers
from ftsup.supervisor.run.outages import Outages
from tests.procs import BIN, PYTHONPATH, REPO, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

PRINT_ENV = (
    "import os, sys; print('rank', os.environ['RANK'], os.environ['FTSUP_WARM_PROBE'], os.getcwd(), "
    "os.environ['FTSUP_ATTEMPT'], flush=True)"
)


def mark(n: int) -> procs.Mark:
    return procs.Mark("warm-test", "node0", n)


def argv_for(tmp: Path, n: int) -> list[str]:
    spec = launcher.LaunchSpec(command=(sys.executable, "-c", PRINT_ENV), nproc=2, log_dir=str(tmp / f"ranks-{n}"))
    return launcher.torchrun_argv(spec)


def park(tmp: Path, n: int) -> warmagent.Spare:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return warmagent.park(n, sys.executable, env=env, cwd=REPO, mark=mark(n))


def test_a_spare_runs_the_attempt_it_was_parked_for_with_the_environment_cwd_and_log_it_is_given(tmp_path):
    spare = park(tmp_path, 3)
    try:
        env = {**os.environ, "FTSUP_WARM_PROBE": "handed-over", "PYTHONUNBUFFERED": "1"}
        log = tmp_path / "attempt-0003.log"
        autogroup = warmrun.session_nice() is not None
        if autogroup:
            wait_for(lambda: session_nice(spare.proc.pid) == str(warmrun.IMPORT_NICE), 60, "the nice was not raised")
        # Stopped, the spare cannot set its session back itself (as one starved beside busy cores cannot): the
        # supervisor does, before the message.
        os.kill(spare.proc.pid, signal.SIGSTOP)
        try:
            att = spare.go(launcher.Launch(3, argv_for(tmp_path, 3), env, tmp_path, log, mark(3)))
            assert not autogroup or session_nice(spare.proc.pid) == "0"
        finally:
            os.kill(spare.proc.pid, signal.SIGCONT)
        assert att is not None and att.pid == spare.proc.pid and att.started_at == spare.started_at
        assert att.proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        text = log.read_text()
        for rank in (0, 1):  # each rank's line, behind torchrun's prefix, in the attempt's log
            assert f"]:rank {rank} handed-over {tmp_path} 3" in text, text[-3000:]
    finally:
        spare.discard()


def test_a_spare_parked_for_another_attempt_or_interpreter_is_stopped_and_not_used(tmp_path):
    spare = park(tmp_path, 2)
    argv = argv_for(tmp_path, 5)
    assert spare.go(launcher.Launch(5, argv, dict(os.environ), tmp_path, tmp_path / "a.log", mark(5))) is None
    assert spare.proc.returncode is not None  # stopped and reaped
    other = park(tmp_path, 5)
    argv[0] = "/usr/bin/python3-other"
    assert other.go(launcher.Launch(5, argv, dict(os.environ), tmp_path, tmp_path / "b.log", mark(5))) is None
    assert other.proc.returncode is not None and not (tmp_path / "b.log").exists()


def test_a_dead_spare_is_not_used_and_its_attempt_starts_cold(tmp_path):
    spare = park(tmp_path, 1)
    spare.proc.send_signal(signal.SIGKILL)
    spare.proc.wait(timeout=10)
    argv = argv_for(tmp_path, 1)
    assert spare.go(launcher.Launch(1, argv, dict(os.environ), tmp_path, tmp_path / "c.log", mark(1))) is None


def test_a_log_file_that_cannot_be_opened_fails_the_launch_as_a_cold_start_would(tmp_path):
    spare = park(tmp_path, 1)
    (tmp_path / "target").write_text("")
    (tmp_path / "d.log").symlink_to(tmp_path / "target")  # never written through a link
    argv = argv_for(tmp_path, 1)
    with pytest.raises(OSError):
        spare.go(launcher.Launch(1, argv, dict(os.environ), tmp_path, tmp_path / "d.log", mark(1)))
    assert spare.proc.returncode is not None and (tmp_path / "target").read_text() == ""


def test_a_spare_let_go_exits_0_and_one_sent_a_bad_message_exits_2(tmp_path):
    spare = park(tmp_path, 1)
    spare.sock.close()  # end of file before a message: let go
    assert spare.proc.wait(timeout=60) == 0
    bad = park(tmp_path, 1)
    with open(os.devnull, "wb") as out:
        socket.send_fds(bad.sock, [warmrun.HEADER.pack(warmrun.MAX_MESSAGE + 1)], [out.fileno()])
    assert bad.proc.wait(timeout=60) == 2
    bad.discard()


def test_the_message_must_be_an_object_of_argv_env_and_cwd(tmp_path):
    for msg in (
        {},
        {"argv": "x", "env": {}, "cwd": "/"},
        {"argv": [], "env": {"A": 1}, "cwd": "/"},
        {"argv": [], "env": {}, "cwd": 3},
    ):
        with pytest.raises(ValueError):
            warmrun._checked(msg)
    assert warmrun._checked({"argv": ["--standalone"], "env": {"A": "b"}, "cwd": "/"}) == (
        ["--standalone"],
        {"A": "b"},
        "/",
    )


def test_a_spare_dies_with_the_process_that_parked_it(tmp_path):
    code = (
        "import os, sys, time; from ftsup import procs; from ftsup.supervisor.run import warmagent;"
        f"s = warmagent.park(1, sys.executable, env=dict(os.environ), cwd={str(REPO)!r},"
        " mark=procs.Mark('w', 'n', 1)); print(s.proc.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        spare = psutil.Process(pid)
        # Between its fork and its exec a child's command line reads empty: the spare is looked at once it runs.
        wait_for(lambda: "torch.distributed.run" in spare.cmdline(), 30, "the spare never ran torch.distributed.run")
        assert spare.ppid() == parent.pid
        parent.kill()
        parent.wait(timeout=10)
        wait_for(lambda: not procs.alive(spare), 30, "the spare outlived the process that parked it")
    finally:
        kill_tree(parent.pid)
        parent.wait(timeout=10)


PROBE = """
import os, subprocess, sys, threading
here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
with open(os.environ["PROBE_OUT"], "a") as f:
    if __name__ != "__main__":
        f.write(f"import {here}\\n")
    else:
        child = subprocess.run([sys.executable, "-c", "import os; print(os.nice(0))"], capture_output=True, text=True)
        f.write(f"main {here}\\nchild {child.stdout.strip()}\\n")
"""


def test_a_spare_imports_at_the_lowest_priority_and_runs_its_attempt_and_the_ranks_at_its_own(tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PROBE_OUT": str(tmp_path / "out")}
    a, b = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "ftsup" / "warmrun.py"), "probe_mod"], stdin=b, env=env, cwd=tmp_path
    )
    try:
        b.close()
        wait_for(lambda: (tmp_path / "out").exists(), 60, "the spare did not import")  # a message hurries it
        body = json.dumps({"argv": [], "env": env, "cwd": str(tmp_path)}).encode()
        with a, open(os.devnull, "wb") as out:
            socket.send_fds(a, [warmrun.HEADER.pack(len(body))], [out.fileno()])
            a.sendall(body)
        assert proc.wait(timeout=60) == 0
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=10)
    base = os.nice(0)
    lines = (tmp_path / "out").read_text().split()
    assert lines == ["import", str(min(base + warmrun.IMPORT_NICE, 19)), "main", str(base), "child", str(base)]


def test_the_message_is_json_of_the_documented_shape(tmp_path):
    body = json.dumps({"argv": ["--standalone"], "env": {"A": "b"}, "cwd": str(tmp_path)}).encode()
    a, b = socket.socketpair()
    with a, b, open(os.devnull, "wb") as out:
        socket.send_fds(a, [warmrun.HEADER.pack(len(body))], [out.fileno()])
        a.sendall(body)
        got = warmrun._read_message(b)
        assert got is not None
        msg, fd = got
        os.close(fd)
    assert warmrun._checked(msg) == (["--standalone"], {"A": "b"}, str(tmp_path))


def workers_for(tmp: Path, now: list[float], warm: bool) -> tuple[workers.Workers, list[tuple[str, dict]]]:
    raw = {
        "job": {
            "command": [sys.executable, "-c", "import time; time.sleep(120)"],
            "workdir": str(tmp),
            "state_dir": str(tmp / "state"),
        },
        "launch": {"nproc_per_node": 1, "node_id": "n0", "warm_agent": warm},
        "heartbeat": {"mode": "off"},
    }
    cfg = parse_config(raw, base_dir=tmp)
    (tmp / "state" / "logs").mkdir(parents=True)
    logged: list[tuple[str, dict]] = []

    def emit(level: str, event: str, **fields: object) -> None:
        logged.append((event, fields))

    clock = lambda: now[0]  # noqa: E731
    w = workers.Workers(
        cfg,
        tmp / "state" / "logs",
        clock=clock,
        emit=emit,
        post=lambda ev: None,
        outages=Outages(emit, lambda purpose: None, clock),
        journal=lambda status: None,
        figures=lambda rank, figures: None,
    )
    return w, logged


@pytest.mark.parametrize("warm", [True, False])
def test_with_heartbeats_off_a_spare_is_parked_a_while_after_the_launch_and_the_next_attempt_starts_in_it(
    tmp_path, warm
):
    now = [1000.0]
    w, logged = workers_for(tmp_path, now, warm)
    runtime = tmp_path / "run"
    runtime.mkdir()
    with w.running(runtime):
        w.launch_or_fail(policy.Launch(1, 1, None))
        first = w.attempt
        assert first is not None
        w.watch()
        assert [e for e, _ in logged if e.startswith("spare_")] == []  # no step heard, not long enough
        now[0] += workers.PARK_AFTER_S
        w.watch()
        parked = [f for e, f in logged if e == "spare_agent_parked"]
        assert parked == ([{"attempt": 2, "pid": parked[0]["pid"]}] if warm else []), logged
        w.stop(policy.StopWorkers(1, "a test", grace_s=1.0))
        w.launch_or_fail(policy.Launch(2, 1, 5))
        assert w.attempt is not None and w.attempt.number == 2
        used = [f["pid"] for e, f in logged if e == "spare_agent_used"]
        assert used == ([parked[0]["pid"]] if warm else []) and (not warm or w.attempt.pid == parked[0]["pid"])
        second = w.attempt.pid
        now[0] += workers.PARK_AFTER_S
        w.watch()  # attempt 2's spare, parked for attempt 3
        spares = [f["pid"] for e, f in logged if e == "spare_agent_parked"]
        assert len(spares) == (2 if warm else 0)
    # Leaving stops the attempt and the spare that was not used: nothing of either is left.
    assert not procs.pid_alive(second) and not any(procs.pid_alive(p) for p in spares)


def test_a_failed_rank_gives_the_agent_torchruns_exit_status_and_report_as_a_plain_torchrun_would(tmp_path):
    spec = launcher.LaunchSpec(
        command=(sys.executable, "-c", "import sys; print('bye', flush=True); sys.exit(3)"),
        nproc=2,
        log_dir=str(tmp_path / "ranks"),
    )
    argv = launcher.torchrun_argv(spec)
    log = tmp_path / "attempt-0001.log"
    spare = warmagent.park(1, sys.executable, env=dict(os.environ), cwd=REPO, mark=mark(1), log_path=log)
    att = spare.go(launcher.Launch(1, argv, dict(os.environ), tmp_path, log, mark(1)))
    assert att is not None
    assert att.proc.wait(timeout=120) == 1
    text = log.read_text()
    assert "ChildFailedError" in text and "exitcode  : 3" in text, text[-3000:]


def test_an_interpreter_that_cannot_import_torchrun_says_so_in_the_attempts_log(tmp_path):
    log = tmp_path / "attempt-0001.log"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    spare = warmagent.park(1, sys.executable, env=env, cwd=tmp_path, mark=mark(1), log_path=log)
    att = spare.go(launcher.Launch(1, argv_for(tmp_path, 1), env, tmp_path, log, mark(1)))
    rc = spare.proc.wait(timeout=60) if att is None else att.proc.wait(timeout=60)
    assert rc == 1 and "ImportError: this torch is broken on purpose" in log.read_text()


def test_the_chaos_check_for_stale_processes_passes_over_a_parked_spare_and_flags_any_other(tmp_path):
    from ftsup.protocol import ATTEMPT_ENV, RUN_ID_ENV
    from ftsup.tools.faults.inject import stale_processes

    run_id = f"stale-{os.getpid()}"
    started = []

    def start(attempt: int, argv: list[str]) -> subprocess.Popen:
        a, b = socket.socketpair()
        env = {**os.environ, RUN_ID_ENV: run_id, ATTEMPT_ENV: str(attempt)}
        proc = subprocess.Popen(argv, stdin=b.fileno(), env=env)
        b.close()
        started.append((proc, a))
        return proc

    spare = [sys.executable, str(REPO / "ftsup" / "warmrun.py"), "json"]  # waits for its message
    try:
        start(4, spare)  # parked for the attempt after the current one (3)
        late = start(5, spare)  # parked for no attempt that can come next
        early = start(2, [sys.executable, "-c", "import time; time.sleep(60)"])  # an earlier attempt's
        wait_for(lambda: all(procs.alive(psutil.Process(p.pid)) for p, _ in started), 30, "the processes starting")
        stale = stale_processes(run_id, {None: 3})
        assert sorted(int(s.split()[1]) for s in stale) == sorted([late.pid, early.pid]), stale
    finally:
        for proc, a in started:
            a.close()
            proc.kill()
            proc.wait(timeout=10)


def test_a_process_of_the_attempt_that_began_during_the_check_is_not_stale_and_an_earlier_ones_is(tmp_path):
    from ftsup.protocol import ATTEMPT_ENV, RUN_ID_ENV
    from ftsup.tools.faults.inject import stale_after_relaunch

    run_id = f"moved-{os.getpid()}"
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = [subprocess.Popen(argv, env={**os.environ, RUN_ID_ENV: run_id, ATTEMPT_ENV: str(n)}) for n in (2, 4)]
    reads = iter([{None: 3}, {None: 4}])  # the job's attempt 4 began while the processes were scanned
    try:
        wait_for(lambda: all(procs.alive(psutil.Process(p.pid)) for p in started), 30, "the processes starting")
        stale = stale_after_relaunch(run_id, lambda: next(reads))
        assert [int(s.split()[1]) for s in stale] == [started[0].pid], stale
    finally:
        for proc in started:
            proc.kill()
            proc.wait(timeout=10)


def session_nice(pid: int) -> str:
    with open(f"/proc/{pid}/autogroup") as f:  # "/autogroup-N nice K"
        return f.read().split()[-1]


def thread_nices(pid: int) -> set[int]:
    return {psutil.Process(t.id).nice() for t in psutil.Process(pid).threads()}


def gated_spare(tmp: Path, out: IO[bytes] | None = None) -> tuple[subprocess.Popen[bytes], socket.socket, Path]:
    """A spare, in a session of its own, its output to `out`, whose import (`tests/bin/gated_import.py`) waits until
    the FIFO it returns is opened and closed for writing; the supervisor's end of its channel."""
    gate = tmp / "gate"
    os.mkfifo(gate)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {**os.environ, "PYTHONPATH": f"{BIN}{os.pathsep}{PYTHONPATH}", "FTSUP_TEST_GATE": str(gate)}
    argv = [sys.executable, warmrun.__file__, "gated_import"]
    with theirs:
        proc = subprocess.Popen(argv, stdin=theirs.fileno(), stdout=out, stderr=out, env=env, start_new_session=True)
    return proc, ours, gate


@pytest.mark.skipif(not os.path.exists(warmrun.AUTOGROUP), reason="this kernel has no autogroup")
def test_a_spare_imports_at_its_sessions_lowest_priority_and_takes_the_message_at_the_usual_one(tmp_path):
    with open(tmp_path / "parked.log", "ab") as parked:
        proc, ours, gate = gated_spare(tmp_path, parked)
    try:
        wait_for(lambda: session_nice(proc.pid) == str(warmrun.IMPORT_NICE), 60, "the session's nice was not raised")
        body = json.dumps({"argv": ["handed-over"], "env": dict(os.environ), "cwd": str(tmp_path)}).encode()
        with open(tmp_path / "attempt.log", "ab") as out:
            socket.send_fds(ours, [warmrun.HEADER.pack(len(body))], [out.fileno()])
        ours.sendall(body)
        # The message came while the import waits behind the gate: the session is back at the usual priority, and
        # so is the import's thread where this process may lower a nice (root).
        wait_for(lambda: session_nice(proc.pid) == "0", 60, "the session's nice was not set back")
        if os.geteuid() == 0:
            wait_for(lambda: thread_nices(proc.pid) == {os.nice(0)}, 60, "the import's thread was left at +19")
        assert proc.poll() is None
        with open(gate, "w"):
            pass  # the import goes on, then the module runs as __main__ at the usual priority
        assert proc.wait(timeout=60) == 0, (tmp_path / "parked.log").read_text()
        assert "ran ['handed-over']" in (tmp_path / "attempt.log").read_text()
        assert (tmp_path / "attempt.log").read_text().strip().endswith("nice 0")
    finally:
        ours.close()
        kill_tree(proc.pid)
        proc.wait(timeout=10)


MAIN_ONLY = """
import threading
if threading.current_thread() is not threading.main_thread():
    raise RuntimeError("import me on the main thread")
if __name__ == "__main__":
    print("ran", flush=True)
"""


def test_an_import_the_thread_cannot_make_is_made_on_the_main_thread_and_one_that_fails_stops_the_spare_unasked(
    tmp_path,
):
    (tmp_path / "main_only.py").write_text(MAIN_ONLY)
    (tmp_path / "broken.py").write_text("raise ImportError('broken on purpose')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for module in ("main_only", "broken"):
        a, b = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, warmrun.__file__, module], stdin=b, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        b.close()
        try:
            if module == "broken":  # dead before any message: the supervisor starts the attempt cold
                _, err = proc.communicate(timeout=60)
                assert (proc.returncode, b"broken on purpose" in err) == (1, True)
                continue
            body = json.dumps({"argv": [], "env": env, "cwd": str(tmp_path)}).encode()
            with open(tmp_path / "main_only.log", "wb") as out:
                socket.send_fds(a, [warmrun.HEADER.pack(len(body))], [out.fileno()])
            a.sendall(body)
            assert proc.wait(timeout=60) == 0 and (tmp_path / "main_only.log").read_text() == "ran\n"
        finally:
            a.close()
            kill_tree(proc.pid)
            proc.communicate(timeout=10)


@pytest.mark.skipif(not os.path.exists(warmrun.AUTOGROUP), reason="this kernel has no autogroup")
def test_the_supervisor_sets_a_spares_session_back_to_the_usual_priority_and_no_other_session(tmp_path):
    spare, ours, _gate = gated_spare(tmp_path)
    member = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        wait_for(lambda: session_nice(spare.pid) == str(warmrun.IMPORT_NICE), 60, "the session's nice was not raised")
        # What `Spare.discard` does before its SIGKILL; a process that leads no session of its own is left alone.
        assert (warmrun.set_session_nice(0, spare.pid), session_nice(spare.pid)) == (True, "0")
        assert warmrun.set_session_nice(5, member.pid) is False
    finally:
        ours.close()
        member.communicate(timeout=30)
        kill_tree(spare.pid)
        spare.wait(timeout=10)
