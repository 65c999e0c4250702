"""A parked launcher: an interpreter that has imported torchrun already and waits to be told what to run.

Stdlib only, importing nothing of ftsup before the message: the job's interpreter runs it by path. The supervisor
side is `ftsup.supervisor.run.warmagent` (docs/design/process-and-protocol.md, The spare launcher).
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import runpy
import select
import socket
import struct
import sys
import threading
import time

HEADER = struct.Struct(">Q")
MAX_MESSAGE = 16 << 20  # an environment of many megabytes is not an environment
_EXIT_BAD_MESSAGE = 2
_EXIT_NO_CWD = 127  # what the guard returns for a command it cannot run


def _read_message(sock: socket.socket) -> tuple[dict[str, object], int] | None:
    """The message and its file descriptor; None at end of file before any of it."""
    head, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, 1)
    if not head and not fds:
        return None
    if len(fds) != 1:
        raise ValueError(f"expected one file with the message, got {len(fds)}")
    while len(head) < HEADER.size:
        more = sock.recv(HEADER.size - len(head))
        if not more:
            raise ValueError("the message ended inside its header")
        head += more
    (length,) = HEADER.unpack(head)
    if length > MAX_MESSAGE:
        raise ValueError(f"a message of {length} bytes is above the cap of {MAX_MESSAGE}")
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(min(1 << 16, length - len(body)))
        if not chunk:
            raise ValueError(f"the message ended after {len(body)} of {length} bytes")
        body += chunk
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ValueError("the message is not a JSON object")
    return msg, fds[0]


def _checked(msg: dict[str, object]) -> tuple[list[str], dict[str, str], str]:
    argv, env, cwd = msg.get("argv"), msg.get("env"), msg.get("cwd")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv must be a list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env must map strings to strings")
    if not isinstance(cwd, str):
        raise ValueError("cwd must be a string")
    return argv, env, cwd


def main(args: list[str]) -> int:
    if len(args) != 1:
        print("warmrun: usage: warmrun.py MODULE (the message comes on standard input)", file=sys.stderr)
        return _EXIT_BAD_MESSAGE
    module = args[0]
    sock = socket.socket(fileno=os.dup(0))
    lowered = set_session_nice(IMPORT_NICE)
    importing = _Import(module)  # the slow part, done before anyone waits for it
    over = importing.wait_or_readable(sock)
    # The message may be here: torchrun runs at the usual priority. The supervisor sets the session back before it
    # sends one (a session at +19 beside busy cores may wait seconds for the CPU to set itself back).
    if lowered and not set_session_nice(0):
        print(f"warmrun: cannot set the session's nice back to 0 in {AUTOGROUP}", file=sys.stderr)
    if over:
        importing.finish()  # one that failed on its thread is made again now, before the message is taken
    else:
        importing.hurry()
    try:
        got = _read_message(sock)
        if got is None:
            return 0
        msg, out_fd = got
        argv, env, cwd = _checked(msg)
    except (OSError, ValueError) as e:
        print(f"warmrun: cannot read the launch message: {e}", file=sys.stderr)
        return _EXIT_BAD_MESSAGE
    finally:
        sock.close()
    importing.finish()  # before the environment changes under it
    # Run afresh as __main__ below (runpy would warn that the module is imported already); its imports stay cached.
    sys.modules.pop(module, None)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    try:
        os.chdir(cwd)
    except OSError as e:
        print(f"warmrun: cannot enter the working directory {cwd!r}: {e.strerror or e}", file=sys.stderr)
        return _EXIT_NO_CWD
    sys.argv = [module, *argv]
    return _run(module)


IMPORT_NICE = 19
"""How much lower the import's priority is: the spare imports while the ranks it will replace train, and on a node
with few cores its import must not slow one of them."""
AUTOGROUP = "/proc/self/autogroup"
_AUTOGROUP_RETRY_S = 2.0  # an unprivileged change is refused (EAGAIN) within 0.1 s of anyone's last one


def _autogroup(pid: int | None) -> str:
    return AUTOGROUP if pid is None else f"/proc/{int(pid)}/autogroup"


def session_nice(pid: int | None = None) -> int | None:
    """The nice of the scheduling group of `pid`'s session (None: this process's); None without autogroup."""
    try:
        with open(_autogroup(pid)) as f:  # "/autogroup-12 nice 0"
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def set_session_nice(nice: int, pid: int | None = None) -> bool:
    """Set the nice of the scheduling group of the session that `pid` (None: this process) leads (Linux's
    autogroup, where each session competes with the others as one: a thread's own nice counts only inside it, and
    the ranks run in sessions of their own). Only for a session's leader, whose session it is; True when set."""
    if os.getsid(pid or 0) != (pid or os.getpid()):
        return False
    if session_nice(pid) == nice:
        return True  # a write would only start the kernel's wait before the next change
    path = _autogroup(pid)
    deadline = time.monotonic() + _AUTOGROUP_RETRY_S
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                os.write(fd, str(nice).encode())
            finally:
                os.close(fd)
            return True
        except OSError as e:
            if e.errno != errno.EAGAIN or time.monotonic() > deadline:
                return False
            time.sleep(0.01)


class _Import:
    """`module` imported on a thread of its own whose nice value is raised by IMPORT_NICE (on Linux a thread's own:
    the main thread's stays as it was, and so does everything it starts later, torchrun and the ranks among them).
    An import that fails there (a module that must be imported on the main thread) is made again on the main
    thread, where any error is the interpreter's own, as with `python -m`."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.done = False
        self._tid: int | None = None
        self._hurried = False
        self._lock = threading.Lock()
        self._signal_r, self._signal_w = os.pipe()
        self._thread = threading.Thread(target=self._work, name="warmrun-import", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        with self._lock:
            self._tid = threading.get_native_id()
            try:
                if not self._hurried:
                    os.setpriority(os.PRIO_PROCESS, self._tid, IMPORT_NICE)
            except (OSError, AttributeError):
                pass  # no per-thread priority here: imported at the process's own
        try:
            __import__(self.module)
            self.done = True
        except BaseException:  # noqa: BLE001 - made again on the main thread, which reports it
            pass
        finally:
            with self._lock:
                self._tid = None  # a thread id is reused once the thread is gone: never reniced after that
            os.write(self._signal_w, b"x")

    def wait_or_readable(self, sock: socket.socket) -> bool:
        """Wait until the import is over or `sock` has something to read (the message, or its end); whether the
        import is over."""
        ready, _, _ = select.select([self._signal_r, sock.fileno()], [], [])
        return self._signal_r in ready

    def hurry(self) -> None:
        """The message came first: the import goes on at the main thread's priority where this process may lower
        a nice (root, or RLIMIT_NICE); elsewhere at its own, which weighs only inside the session with autogroup."""
        with self._lock:
            self._hurried = True
            if self._tid is not None:
                try:
                    os.setpriority(os.PRIO_PROCESS, self._tid, os.getpriority(os.PRIO_PROCESS, 0))
                except OSError:
                    pass

    def finish(self) -> None:
        """Wait for the import; one that failed on the thread is made again on this one. Once."""
        if self._signal_r < 0:
            return
        self._thread.join()
        os.close(self._signal_r)
        os.close(self._signal_w)
        self._signal_r = self._signal_w = -1
        if not self.done:
            __import__(self.module)


def _run(module: str) -> int:
    """Run `module` as `__main__`; its exit status as the interpreter would give it (an uncaught exception: its
    traceback, then 1)."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - KeyboardInterrupt too: reported, not re-raised into the teardown
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def finish(status: int) -> None:
    """Exit with `status` as the interpreter would, without its teardown: threads joined and `atexit` run (logs
    flushed, files closed), then `os._exit`. Tearing down the modules of an interpreter that holds torch is slow,
    torchrun's exit is on every relaunch's path, and nothing in that teardown is anyone's."""
    shutdown = getattr(threading, "_shutdown", None)  # joins non-daemon threads, as the interpreter's exit does
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status & 0xFF)


if __name__ == "__main__":
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run by path: ftsup's own directory must not shadow anything the module imports
    finish(main(sys.argv[1:]))
