"""Taking one rank's stacks (`run.stacktools`): a tool that hangs is stopped at its deadline with whatever it started,
a missing or failing tool passes to the next one, and without any the kernel's view of each thread is read."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ftsup.supervisor.run import stacktools
from ftsup.supervisor.run.stacktools import Tool
from tests.procs import BIN, wait_for

STUCK = BIN / "stuck_tool"


@pytest.fixture
def sleeper():
    code = "import sys, time; print('sleeping', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"sleeping\n"  # past its start-up's own waits
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_SLEEPING, 10, "the sleeper to sleep")
    yield proc
    proc.kill()
    proc.wait()
    proc.stdout.close()


def test_a_tool_that_never_answers_is_stopped_at_its_deadline_with_the_child_it_started():
    t0 = time.monotonic()
    ran = stacktools.run([str(STUCK / "pystack"), "remote", "1"], t0 + 0.5, time.monotonic)
    took = time.monotonic() - t0
    assert (ran.code, ran.timed_out, ran.out, 0.5 <= took < 1.5) == (None, True, b"Traceback for thread", True)
    left = [p for p in psutil.process_iter(["cmdline"]) if "stuck_tool" in " ".join(p.info["cmdline"] or ())]
    wait_for(lambda: not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 5, "leftovers")


def test_a_tool_that_floods_its_output_is_stopped_at_the_cap(tmp_path: Path):
    flood = tmp_path / "pystack"
    flood.write_text("#!/bin/sh\nexec yes 'Traceback for thread 1 (python) [] (most recent call last):'\n")
    flood.chmod(0o755)
    ran = stacktools.run([str(flood)], time.monotonic() + 20, time.monotonic)
    assert (ran.code, ran.timed_out, len(ran.out)) == (None, False, stacktools.MAX_OUTPUT)


def test_a_missing_tool_is_named_and_the_next_one_is_found_on_path(tmp_path: Path):
    found, missing = stacktools.find_tools(["/nowhere/pystack", "py-spy"], {"PATH": str(STUCK)})
    assert ([(t.kind, t.path) for t in found], missing) == (
        [("py-spy", str(STUCK / "py-spy"))],
        ["/nowhere/pystack: not found (install ftsup[forensics], or set forensics.tools)"],
    )


def test_every_tool_runs_at_once_and_the_first_listed_that_answers_by_the_bound_is_taken(
    sleeper: subprocess.Popen[bytes], tmp_path: Path
):
    answering = tmp_path / "py-spy"
    answering.write_text(f"#!/bin/sh\necho 'Thread {sleeper.pid} (idle): \"MainThread\"'\necho '    f (x.py:1)'\n")
    answering.chmod(0o755)
    tools = [Tool("pystack", str(STUCK / "pystack")), Tool("py-spy", str(answering))]
    problems: list[str] = []
    t0 = time.monotonic()
    threads, tool, held = stacktools.take(tools, sleeper.pid, "S", t0 + 1.0, time.monotonic, problems)
    took = time.monotonic() - t0
    got = ([t.frames for t in threads], tool, [p.split(" within")[0] for p in problems], 1.0 <= took < 2.0, held)
    assert got == ([("f (x.py:1)",)], "py-spy", ["pystack: no answer"], True, True)  # pystack killed: it may hold it


def test_a_tool_that_fails_is_said_with_its_last_line_and_the_next_one_answers(
    sleeper: subprocess.Popen[bytes], tmp_path: Path
):
    failing = tmp_path / "pystack"
    failing.write_text("#!/bin/sh\necho 'Operation not permitted' >&2\nexit 1\n")
    failing.chmod(0o755)
    tools = [Tool("pystack", str(failing)), Tool("py-spy", str(STUCK / "py-spy"))]
    problems: list[str] = []
    t0 = time.monotonic()
    got = stacktools.take(tools, sleeper.pid, "S", t0 + 0.5, time.monotonic, problems)
    assert (got, [p.split(" within")[0] for p in problems]) == (
        ([], None, False),  # pystack let go by itself; py-spy without a stop was killed
        ["pystack: exit 1: Operation not permitted", "py-spy: no answer"],
    )


def test_without_a_tool_each_thread_is_read_from_proc_with_its_state(sleeper: subprocess.Popen[bytes]):
    threads = stacktools.kernel_threads(sleeper.pid)
    main = [t for t in threads if t.main]
    assert (len(main), main[0].tid, main[0].status) == (1, sleeper.pid, "state S")


def test_py_spy_stops_a_process_for_its_native_frames_only_alone_and_reads_it_unstopped_at_once():
    pystack, pyspy = Tool("pystack", "pystack"), Tool("py-spy", "py-spy")
    named = [
        [(name, cmd[-1]) for _, name, cmd in stacktools.commands(tools, 7, state)]
        for tools, state in (([pystack, pyspy], "S"), ([pyspy], "S"), ([pyspy], "T"))
    ]
    assert named == [
        [("pystack", "7"), ("py-spy", "--nonblocking")],
        [("py-spy --native", "--native"), ("py-spy", "--nonblocking")],
        [("py-spy", "--nonblocking")],
    ]


@pytest.mark.skipif(not os.access("/proc/self/task", os.R_OK), reason="no /proc")
def test_a_thread_waiting_in_the_kernel_says_where(sleeper: subprocess.Popen[bytes]):
    # Once in its long sleep: a read in the moment between its print and its sleep finds it running (None).
    wait_for(lambda: stacktools.wchan(sleeper.pid) is not None, 10, "the sleeper's wait channel")
