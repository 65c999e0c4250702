"""The one stop sequence, the attempt's mark and the parent-death guard, on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ftsup import guard, procs
from ftsup.supervisor.run import launcher
from tests.procs import kill_tree, wait_for

MARK = procs.Mark("run-t", "node-t", 3)
IGNORES_SIGTERM = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"  # noqa: E501


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; each is killed (with its tree) and reaped at the end."""
    out: list[subprocess.Popen[bytes]] = []
    yield out
    for p in out:
        kill_tree(p.pid)
        p.wait(timeout=10)


def spawn(
    started: list[subprocess.Popen[bytes]], code: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **(env or {})}, stdout=subprocess.PIPE)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


READY_AND_SLEEP = "print('ready', flush=True); import time; time.sleep(60)"


def test_stop_sigkills_a_process_that_ignores_sigterm_after_one_grace_deadline(started):
    p = spawn(started, IGNORES_SIGTERM)
    t0 = time.monotonic()
    left = procs.stop(lambda: procs.descendants([p.pid]), 0.5, reap=p.poll)
    assert (left, p.wait(timeout=5), time.monotonic() - t0 >= 0.5) == ([], -signal.SIGKILL, True)


def test_stop_continues_a_stopped_process_so_that_sigterm_ends_it_within_the_grace(started):
    p = spawn(started, READY_AND_SLEEP)
    os.kill(p.pid, signal.SIGSTOP)
    left = procs.stop(lambda: procs.descendants([p.pid]), 10, reap=p.poll)
    assert (left, p.wait(timeout=5)) == ([], -signal.SIGTERM)


def test_run_state_reads_a_stopped_process_as_t_and_the_same_start_time_as_before(started):
    p = spawn(started, READY_AND_SLEEP)
    before = procs.run_state(p.pid)
    os.kill(p.pid, signal.SIGSTOP)
    after = wait_for(lambda: (got := procs.run_state(p.pid)) and got[0] == "T" and got, 5, "never seen stopped")
    assert (before is not None and before[0] in "RS", after[1] == before[1]) == (True, True)


def test_run_state_reads_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    (tmp_path / "42").mkdir()
    rest = " ".join(["D", *["0"] * 18, "123456", "0"])
    (tmp_path / "42" / "stat").write_bytes(b"42 (a) b (c)) " + rest.encode())
    assert procs.run_state(42, proc=str(tmp_path)) == ("D", 123456)


def test_run_state_of_no_process_or_a_short_file_is_none(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_bytes(b"7 (x) S 1 2")
    assert (procs.run_state(8, proc=str(tmp_path)), procs.run_state(7, proc=str(tmp_path))) == (None, None)


def test_stop_leaves_the_exit_status_of_our_child_to_its_popen(started):
    # psutil's wait reaps a child itself; Popen then reads the status of a reaped child as 0.
    p = spawn(started, READY_AND_SLEEP)
    att = launcher.RunningAttempt(1, p, Path(os.devnull), time.time(), MARK)  # type: ignore[arg-type]
    assert (att.stop(5), att.poll()) == ([], -signal.SIGTERM)


def test_stop_also_stops_a_process_that_appears_during_the_grace(started):
    first = spawn(started, IGNORES_SIGTERM)
    late: list[subprocess.Popen[bytes]] = []

    def found() -> list[psutil.Process]:
        if not late:  # appears after the first signals went out
            late.append(spawn(started, READY_AND_SLEEP))
        return procs.descendants([first.pid, late[0].pid])

    assert procs.stop(found, 0.5, reap=lambda: [p.poll() for p in started]) == []
    assert late[0].wait(timeout=5) == -signal.SIGTERM


def test_stop_with_no_grace_sigkills_at_once(started):
    p = spawn(started, READY_AND_SLEEP)
    assert (procs.stop(lambda: procs.descendants([p.pid]), 0, reap=p.poll), p.wait(timeout=5)) == ([], -signal.SIGKILL)


def test_a_process_without_the_attempts_mark_is_not_a_process_of_the_attempt(started):
    p = spawn(started, READY_AND_SLEEP)
    assert procs.verify(p.pid, MARK, since=time.time() - 60) is None


def test_a_process_with_the_mark_created_before_the_attempt_started_is_not_one_of_it(started):
    p = spawn(started, READY_AND_SLEEP, MARK.environ())
    assert procs.verify(p.pid, MARK, since=time.time() + 60) is None


def test_a_process_with_another_attempts_mark_is_not_one_of_it(started):
    p = spawn(started, READY_AND_SLEEP, procs.Mark("run-t", "node-t", 4).environ())
    assert procs.verify(p.pid, MARK, since=time.time() - 60) is None


def test_a_process_with_the_mark_created_within_the_attempt_is_found_by_the_scan(started):
    since = time.time()
    p = spawn(started, READY_AND_SLEEP, MARK.environ())
    assert procs.verify(p.pid, MARK, since=since) is not None
    assert [q.pid for q in procs.find(MARK, since=since)] == [p.pid]


def guarded_sleeper_under(started: list[subprocess.Popen[bytes]]) -> tuple[subprocess.Popen[bytes], int]:
    """A middle process that starts `sleep` behind the guard and prints its pid."""
    code = (
        "import subprocess, sys\n"
        "from ftsup import guard\n"
        "argv, env = guard.wrap(['sleep', '60'], ignore=[10])\n"
        "import os\n"
        "c = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)\n"
        "print(c.pid, flush=True)\n"
        "c.wait()\n"
    )
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    started.append(middle)
    assert middle.stdout is not None
    return middle, int(middle.stdout.readline())


def cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []


def test_a_guarded_command_dies_with_the_process_that_started_it(started):
    middle, child = guarded_sleeper_under(started)
    wait_for(lambda: cmdline(child) == ["sleep", "60"], 10, "the guard did not exec the command")
    middle.kill()
    wait_for(lambda: not procs.pid_alive(child), 10, "the guarded command outlived its parent")


def test_a_guarded_command_ignores_the_signals_it_was_asked_to(started):
    middle, child = guarded_sleeper_under(started)
    wait_for(lambda: cmdline(child) == ["sleep", "60"], 10, "the guard did not exec the command")
    status = Path(f"/proc/{child}/status").read_text().splitlines()
    ignored = int(next(x for x in status if x.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (signal.SIGUSR1 - 1))


def test_the_guard_never_runs_the_command_when_its_parent_is_not_the_one_named(tmp_path):
    # What a child finds when its launcher died before the guard was armed: another parent.
    marker = tmp_path / "ran"
    argv = guard.command(["touch", str(marker)])
    done = subprocess.run(argv, env={**os.environ, guard.PARENT_ENV: "1"}, timeout=30, check=False)
    assert (done.returncode, marker.exists()) == (-signal.SIGKILL, False)


def test_the_guard_names_the_command_as_the_parent_for_the_next_guard(tmp_path):
    argv, env = guard.wrap([sys.executable, "-c", f"import os; print(os.environ[{guard.PARENT_ENV!r}], os.getpid())"])
    out = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=30, check=True)
    named, pid = out.stdout.split()
    assert named == pid


# A stand-in for torchrun: a worker group of two sleeping ranks, replaced whole on each line of its input.
GROUP = """
import subprocess, sys
def group():
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    print(" ".join(str(k.pid) for k in kids), flush=True)
    return kids
kids = group()
for line in sys.stdin:
    for k in kids:
        k.kill()
        k.wait()
    kids = group()
"""


def test_rank_pids_follows_a_replaced_group_and_reads_the_process_table_only_when_it_changed(started, monkeypatch):
    p = subprocess.Popen([sys.executable, "-c", GROUP], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    started.append(p)
    assert p.stdin is not None and p.stdout is not None
    first = frozenset(map(int, p.stdout.readline().split()))
    att = launcher.RunningAttempt(1, p, Path(os.devnull), time.time(), MARK)  # type: ignore[arg-type]
    scans: list[int] = []
    children = psutil.Process.children
    monkeypatch.setattr(psutil.Process, "children", lambda self, **kw: scans.append(self.pid) or children(self, **kw))
    unchanged = [att.rank_pids() for _ in range(5)]
    p.stdin.write(b"replace\n")
    p.stdin.flush()
    second = frozenset(map(int, p.stdout.readline().split()))
    assert (unchanged, len(scans), att.rank_pids(), scans) == ([first] * 5, 1, second, [p.pid, p.pid])
