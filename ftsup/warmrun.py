"""A parked launcher: an interpreter that has imported torchrun already and waits to be told what to run.

Stdlib only, importing nothing of ftsup before the message: the job's interpreter runs it by path. The supervisor
side is `ftsup.supervisor.run.warmagent` (docs/design/process-and-protocol.md, The spare launcher).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import socket
import struct
import sys
import threading

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
    _import_in_background(module)  # the slow part, done before anyone waits for it
    # Run afresh as __main__ below (runpy would warn that the module is imported already); its imports stay cached.
    sys.modules.pop(module, None)
    sock = socket.socket(fileno=os.dup(0))
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
"""How much lower the importing thread's priority is than the rest of the process's: the spare imports while the
ranks it will replace train, and on a node with few cores its import must not slow one of them."""


def _import_in_background(module: str) -> None:
    """Import `module` on a thread of its own whose nice value is raised by IMPORT_NICE (on Linux a thread's own: this
    thread's stays as it was, and so does everything it starts later, torchrun and the ranks among them); waits for
    it. An import that fails there (a module that must be imported on the main thread) is made again here, where
    any error is the interpreter's own, as with `python -m`."""
    done: list[bool] = []

    def work() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMPORT_NICE)
        except (OSError, AttributeError):
            pass  # no per-thread priority here: imported at the process's own
        try:
            __import__(module)
            done.append(True)
        except BaseException:  # noqa: BLE001 - made again on the main thread, which reports it
            pass

    t = threading.Thread(target=work, name="warmrun-import", daemon=True)
    t.start()
    t.join()
    if not done:
        __import__(module)


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
