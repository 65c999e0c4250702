"""One rank's stacks, taken by a stack tool (pystack, py-spy) under a hard deadline, or else read from /proc: the
process state, each thread's kernel wait channel (docs/incidents.md, Hangs: the evidence before the kill).
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ftsup.supervisor.policy import stacks
from ftsup.supervisor.policy.hangs import STUCK
from ftsup.supervisor.policy.stacks import Thread

MAX_OUTPUT = 4 << 20  # a tool's stdout read at most; past it the tool is stopped and what it printed kept
MAX_ERROR = 16 << 10  # of its stderr, the end kept
REAP_S = 0.5  # after SIGKILL, the longest waited for a tool to be reaped
CANCEL_POLL_S = 0.05  # how often a tool's run looks whether it is still needed
STOP_S = 0.1  # past its deadline or its cancel, the longest waited for a tool to be stopped and reaped before going on
_KERNEL = "[kernel] "
_PROC = "/proc"


@dataclass(frozen=True)
class Tool:
    kind: str  # pystack or py-spy
    path: str


def find_tools(names: Sequence[str], environ: Mapping[str, str]) -> tuple[list[Tool], list[str]]:
    """The tools of `names` found (a path as given; a name on PATH, else beside this interpreter, where pip put
    it), in order, and a line for each one missing."""
    found, missing = [], []
    beside = str(Path(sys.executable).parent)
    for name in names:
        kind = Path(name).name
        if os.sep in name:
            path = name if os.access(name, os.X_OK) and os.path.isfile(name) else None
        else:
            path = shutil.which(name, path=environ.get("PATH", os.defpath)) or shutil.which(name, path=beside)
        if path is None:
            missing.append(f"{name}: not found (install ftsup[forensics], or set forensics.tools)")
        else:
            found.append(Tool(kind, path))
    return found, missing


def commands(tools: Sequence[Tool], pid: int, state: str | None) -> list[tuple[Tool, str, list[str]]]:
    """The commands that print `pid`'s stacks, in the order they are preferred, each with what it is called. py-spy's
    default mode stops the process (ptrace) to read it, as pystack does, and only then reads native frames: beside
    pystack, or for a stopped process (which it cannot stop), it reads without stopping it, Python frames only; alone,
    a running process is read both ways at once, the native frames preferred."""
    out: list[tuple[Tool, str, list[str]]] = []
    tracer = any(t.kind == "pystack" for t in tools)
    for tool in tools:
        if tool.kind == "pystack":
            out.append((tool, tool.kind, [tool.path, "remote", "--native-last", "--no-color", str(pid)]))
            continue
        if not tracer and state not in STUCK:
            out.append((tool, f"{tool.kind} --native", [tool.path, "dump", "--pid", str(pid), "--native"]))
        out.append((tool, tool.kind, [tool.path, "dump", "--pid", str(pid), "--nonblocking"]))
    return out


def stops(command: Sequence[str]) -> bool:
    """Whether `command` (of `commands`) stops the process to read it: every one but py-spy's --nonblocking."""
    return "--nonblocking" not in command


def parse(tool: Tool, text: str, pid: int) -> list[Thread]:
    return stacks.parse_pystack(text, pid) if tool.kind == "pystack" else stacks.parse_pyspy(text, pid)


@dataclass(frozen=True)
class Ran:
    code: int | None  # None: stopped at the deadline, at the output cap, or cancelled
    out: bytes
    err: bytes
    timed_out: bool = False


def run(command: list[str], until: float, clock: Callable[[], float], cancel: threading.Event | None = None) -> Ran:
    """Run `command` (a process of ours, in a session of its own) until it exits, `until` on `clock` or `cancel`,
    reading at most `MAX_OUTPUT` of its output; past any of these, it and whatever it started get SIGKILL. OSError:
    not started."""
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    out, err = bytearray(), bytearray()
    timed_out = cut = False
    with selectors.DefaultSelector() as sel:
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map() and not cut:
            left = until - clock()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(min(left, CANCEL_POLL_S)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(err) > MAX_ERROR:
                    del err[: len(err) - MAX_ERROR]
            cut = len(out) > MAX_OUTPUT or (cancel is not None and cancel.is_set())
    code: int | None = None
    if not (timed_out or cut):
        try:
            code = proc.wait(timeout=max(0.0, until - clock()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if code is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the tool and what it started
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            pass  # unkillable for now (uninterruptible sleep): Popen reaps it later
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return Ran(code, bytes(out[:MAX_OUTPUT]), bytes(err), timed_out)


def take(
    tools: Sequence[Tool],
    pid: int,
    state: str | None,
    until: float,
    clock: Callable[[], float],
    problems: list[str],
) -> tuple[list[Thread], str | None, bool]:
    """`pid`'s stacks, the kind of the tool that gave them, and whether a tool that stops the process to read it was
    killed before it let go (it may have left the process stopped): every command of `commands` runs at once, and
    the first that gives a stack by `until` is taken, so that native frames come when pystack (or py-spy alone)
    answers in time, and Python frames when only py-spy's reading without a stop does. What failed is appended to
    `problems` as it is known, so a caller cut short by its own deadline still has it."""
    todo = commands(tools, pid, state)
    results: list[list[Thread] | str | None] = [None] * len(todo)
    let_go = [False] * len(todo)  # the command exited by itself, or never started
    cancel = threading.Event()

    def go(i: int) -> None:
        (tool, name, command), t0 = todo[i], clock()
        try:
            ran = run(command, until, clock, cancel)
        except OSError as e:
            results[i], let_go[i] = f"{name}: cannot run {tool.path}: {e.strerror or e}", True
            return
        let_go[i] = ran.code is not None
        threads = parse(tool, ran.out.decode("utf-8", "replace"), pid)
        last = next((ln for ln in reversed(ran.err.decode("utf-8", "replace").splitlines()) if ln.strip()), "")
        said = f": {stacks.clean(last)[:200]}" if last else ""
        if ran.code == 0 and threads:
            results[i] = threads
        elif ran.timed_out:
            results[i] = f"{name}: no answer within {clock() - t0:.1f}s; stopped"
        elif ran.code is None:
            results[i] = f"{name}: not needed (a tool before it answered); stopped"
        else:
            results[i] = f"{name}: exit {ran.code}{said}" if ran.code else f"{name}: printed no stack"

    workers = [
        threading.Thread(target=go, args=(i,), name=f"ftsup-stack-{pid}-{i}", daemon=True) for i in range(len(todo))
    ]
    for w in workers:
        w.start()
    taken: tuple[list[Thread], str | None] = ([], None)
    try:
        for i, w in enumerate(workers):
            w.join(max(0.0, until - clock()))
            got = results[i]
            if isinstance(got, list):
                taken = got, todo[i][0].kind
                break
            problems.append(got if isinstance(got, str) else f"{todo[i][1]}: no answer within the bound; stopped")
    finally:
        cancel.set()  # the tools after the one taken are not needed: stopped, and reaped (a tracer gone) by now
        for w in workers:
            w.join(max(0.0, max(clock(), until) + CANCEL_POLL_S + STOP_S - clock()))
    held = any(stops(c) and not let_go[i] for i, (_, _, c) in enumerate(todo))
    return *taken, held


def _read(path: str, cap: int = 4096) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, cap).decode("utf-8", "replace")
    except OSError:  # a kernel stack needs privileges
        return None
    finally:
        os.close(fd)


def wchan(pid: int, tid: int | None = None, *, proc: str = _PROC) -> str | None:
    """Where the kernel has the thread wait (`/proc/PID/task/TID/wchan`; None: running, or not known)."""
    got = _read(f"{proc}/{int(pid)}/task/{int(pid if tid is None else tid)}/wchan", 128)
    got = stacks.clean(got or "")
    return None if got in ("", "0") else got


def kernel_threads(pid: int, *, proc: str = _PROC) -> list[Thread]:
    """Each thread of `pid` as the kernel sees it, when no tool gave its stacks: its name, its state and its
    kernel stack (readable by root only), else where it waits."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"{proc}/{int(pid)}/task") if t.isdigit())
    except OSError:
        return []
    threads = []
    for tid in tids[: stacks.MAX_THREADS]:
        base = f"{proc}/{int(pid)}/task/{tid}"
        name = (_read(f"{base}/comm", 64) or "?").strip()
        stat_line = _read(f"{base}/stat") or ""
        state = stat_line[stat_line.rfind(")") + 1 :].split()[:1]
        kernel = [ln.split("] ", 1)[-1] for ln in (_read(f"{base}/stack") or "").splitlines() if ln.strip()]
        where = kernel[::-1][-stacks.MAX_FRAMES :] or [w for w in [wchan(pid, tid, proc=proc)] if w]
        frames = tuple(stacks.clean(_KERNEL + f) for f in where)
        threads.append(Thread(stacks.clean(name), tid, tid == pid, frames, f"state {state[0] if state else '?'}"))
    return threads
