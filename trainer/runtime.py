"""The rank side of the supervisor channel: heartbeats out (`beat`, `phase`), save/stop requests in (`control`,
`agree`, `Agreement`); `runtime()` is the process's client, a no-op without a supervisor.

Sending never blocks and never raises (docs/design/trainer.md, The runtime client; the schemas: `ftsup.protocol`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import math
import os
import socket
import stat
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ftsup import guard
from ftsup.protocol import (
    KEEPALIVE_PHASES,
    MAX_BEAT_BYTES,
    MAX_CONTROL_BYTES,
    MAX_STEP,
    NO_REQUEST,
    PHASE_NAMES,
    STOPPED_ELSEWHERE_STEP,
    ControlVersionError,
    Phase,
    Request,
    RuntimeEnv,
    encode_beat,
    parse_control,
)
from ftsup.store import safefile

_SNDBUF_BYTES = 1 << 20  # room for ~2700 beats (~270 where net.core.wmem_max caps it): a busy supervisor loses none
_RECONNECT_S = 0.05  # at most this often a connect() is tried again after one failed

# ---------------------------------------------------------------------- the client


class RuntimeClient:
    """Heartbeats to the supervisor over one connection per process (a forked child opens its
    own). Thread-safe: the lock is held only around non-blocking socket calls."""

    def __init__(
        self,
        env: RuntimeEnv,
        *,
        clock: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.env = env
        self._clock = clock
        self._mono = mono
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._sock_pid = 0  # the process that opened _sock (a forked child must not write to it)
        self._retry_at = -math.inf
        self._phase = Phase.INIT
        self._step = env.resume_step or 0
        self._warned: set[str] = set()
        self.sent = 0
        self.dropped = 0
        self.control = ControlReader(env.control_file)
        _CLIENTS.add(self)
        if env.heartbeat_socket:
            _arm_parent_death_signal()

    @property
    def supervised(self) -> bool:
        return self.env.heartbeat_socket is not None

    def beat(self, step: int, phase: Phase | str | None = None, **figures: float | int | str) -> None:
        """Report `step` (optimizer steps completed) and the phase; never blocks, never raises. Without a phase the
        rank stays in its current one, except that a rank still in `init` is training from then on: one
        `rt.beat(step)` line per step is a training beat, which the supervisor's hang detection watches."""
        try:
            if phase is None and self._phase == Phase.INIT:
                phase = Phase.TRAIN
            if phase is not None:
                if phase in PHASE_NAMES:
                    self._phase = Phase(phase)
                else:
                    self._warn(
                        "phase", f"ftsup.trainer.runtime: unknown phase {phase!r} ignored (one of {PHASE_NAMES})"
                    )
            try:
                s = int(step)
            except (TypeError, ValueError, OverflowError):
                s = -1
            if not 0 <= s <= MAX_STEP:
                self._warn(
                    "step", f"ftsup.trainer.runtime: step {step!r} is not an integer in [0, {MAX_STEP}]; beat dropped"
                )
                self.dropped += 1
                return
            self._step = s
            self._send(figures)
        except Exception as e:  # an adapter boundary: a heartbeat must never take training down
            self._warn("error", f"ftsup.trainer.runtime: a heartbeat failed ({e!r}); beats that fail are dropped")
            self.dropped += 1

    @contextlib.contextmanager
    def phase(self, name: Phase | str, step: int | None = None, *, timeout_s: float | None = None) -> Iterator[None]:
        """Mark a long phase so that the supervisor applies its timeouts for it: `load` and `save`
        may be silent up to save_timeout_s; in `eval` this client beats every interval_s from a
        thread while the block runs (see the module docstring).

        `timeout_s` (eval): the phase's own limit. Past it the thread stops beating, so that a
        block whose work is stuck while its process lives goes silent and the supervisor's
        heartbeat timeout catches it; without it, the supervisor's save_timeout_s does."""
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive number of seconds or None, not {timeout_s!r}")
        before = self._phase
        self.beat(self._step if step is None else step, name)
        keepalive = None
        if name in KEEPALIVE_PHASES and self.supervised:
            try:
                keepalive = _KeepAlive(self, self.env.heartbeat_interval_s, str(name), timeout_s)
            except RuntimeError as e:  # no thread to be had: the phase still runs, unbeaten
                self._warn("thread", f"ftsup.trainer.runtime: no keepalive thread for phase {name} ({e})")
        try:
            yield
        finally:
            if keepalive is not None:
                keepalive.stop()
            self.beat(self._step, before)

    def report(self, **figures: float | int | str) -> None:
        """Send figures (`save_s`, ...) with the current step and phase (`init` stays `init`); never blocks, never
        raises."""
        self.beat(self._step, self._phase, **figures)

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    # ------------------------------------------------------------------ sending

    def _send(self, figures: Mapping[str, object]) -> None:
        if not self.env.heartbeat_socket:
            return
        payload = self._encode(figures)
        if len(payload) > MAX_BEAT_BYTES:  # only figures can make it this long: send the beat without them
            payload = self._encode(None)
        with self._lock:
            for _ in range(2):  # a second try on a fresh connection when the supervisor closed ours
                sock = self._connected()
                if sock is None:
                    break
                try:
                    sock.send(payload, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                except BlockingIOError:  # the supervisor is behind: drop, never stall training
                    break
                except OSError:  # the supervisor went away or closed this connection
                    self._disconnect()
                    continue
                self.sent += 1
                return
            self.dropped += 1

    def _encode(self, figures: Mapping[str, object] | None) -> bytes:
        """This process's beat at its step and phase, stamped with both clocks now."""
        e = self.env
        return encode_beat(
            attempt=e.attempt,
            rank=e.rank,
            local_rank=e.local_rank,
            pid=os.getpid(),
            step=self._step,
            phase=self._phase,
            t=self._clock(),
            mono=self._mono(),
            figures=figures,
        )

    def _connected(self) -> socket.socket | None:
        """The connection of this process, opened if needed (caller holds the lock)."""
        if self._sock is not None and self._sock_pid == os.getpid():
            return self._sock
        self._disconnect()
        now = self._mono()
        if now < self._retry_at or not self.env.heartbeat_socket:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF_BYTES)
            sock.connect(self.env.heartbeat_socket)  # AF_UNIX: done at once, or EAGAIN when its backlog is full
        except OSError:
            sock.close()
            self._retry_at = now + _RECONNECT_S
            return None
        self._sock, self._sock_pid = sock, os.getpid()
        return sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()  # in a forked child this closes only the child's copy
        self._sock, self._sock_pid = None, 0

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._retry_at = -math.inf

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


class _KeepAlive:
    """A daemon thread that repeats the client's current beat every `interval_s` until stopped, or
    until `timeout_s` has passed (then it stops beating and warns once)."""

    def __init__(self, client: RuntimeClient, interval_s: float, name: str, timeout_s: float | None) -> None:
        self._client = client
        self._interval_s = interval_s
        self._name = name
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftsup-keepalive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = math.inf if self._timeout_s is None else time.monotonic() + self._timeout_s
        while not self._stop.wait(self._interval_s):
            if time.monotonic() >= deadline:
                why = f"phase {self._name} ran past its timeout_s={self._timeout_s:g}"
                self._client._warn(
                    "timeout", f"ftsup.trainer.runtime: {why}; its heartbeats stop (a hang to the supervisor)"
                )
                return
            self._client.beat(self._client._step)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)  # its loop never blocks: it ends within one send


_CLIENTS: weakref.WeakSet[RuntimeClient] = weakref.WeakSet()


def _reset_clients_after_fork() -> None:
    for client in list(_CLIENTS):
        client._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_clients_after_fork)


# ---------------------------------------------------------------------- requests


class ControlReader:
    """Reads the supervisor's control file when it changes (one `lstat()` per call otherwise).

    Only a small regular file is read: a link, a FIFO, a directory, a device or a file past MAX_CONTROL_BYTES is
    refused without being read (a FIFO opened without O_NONBLOCK would block the step), with a warning at most every
    `WARN_EVERY_S`, and the last request stays in force."""

    WARN_EVERY_S = 60.0

    def __init__(self, path: str | None, *, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self._clock = clock
        self._sig: tuple[int, int, int, int] | None = None
        self._last = NO_REQUEST
        self._warned_at = -math.inf
        self.refused = 0  # control files refused: another format version (or none), or not a small regular file

    def poll(self) -> Request:
        if not self.path:
            return NO_REQUEST
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return self._last
        except OSError:
            return self._last  # a path it cannot look at now (a directory on its way gone): the next step looks again
        sig = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)
        if sig == self._sig:
            return self._last
        self._sig = sig
        try:
            self._last = parse_control(_read_small_file(self.path, st.st_mode))
        except _NotAFile as e:
            self._refuse(str(e))
        except ControlVersionError as e:  # a supervisor of another release: its request is not ours to guess
            self._refuse(str(e))
        except (OSError, ValueError):
            self._sig = None  # a torn or odd file: read it again next step
        return self._last

    def _refuse(self, why: str) -> None:
        self.refused += 1
        now = self._clock()
        if now - self._warned_at >= self.WARN_EVERY_S:
            self._warned_at = now
            warnings.warn(
                f"ftsup.trainer.runtime: control file {self.path} refused, its request ignored: {why}",
                RuntimeWarning,
                stacklevel=3,
            )


class _NotAFile(ValueError):
    """The control file's path names something else than a small regular file."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISLNK, "a symbolic link, never followed"),
    (stat.S_ISSOCK, "a socket"),
)


def _read_small_file(path: str, mode: int) -> bytes:
    """The bytes of the regular file at `path`, at most MAX_CONTROL_BYTES + 1 of them; `_NotAFile` for anything else.
    Never blocks: the path is opened without following a link and with O_NONBLOCK, and checked again once open."""
    if not stat.S_ISREG(mode):
        raise _NotAFile(_kind(mode))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # made a link since the lstat
            raise _NotAFile(_kind(stat.S_IFLNK)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped since the lstat
            raise _NotAFile(_kind(st.st_mode))
        if st.st_size > MAX_CONTROL_BYTES:
            raise _NotAFile(f"{st.st_size} bytes, more than the {MAX_CONTROL_BYTES} a request can take")
        return safefile.read_capped(fd, MAX_CONTROL_BYTES)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    kind = next((name for test, name in _KINDS if test(mode)), "a device")
    return f"{kind}, not a regular file"


def agree(request: Request, device: Any = None) -> Request:
    """All ranks of the job agree on the newest request (one all-reduce of two integers, MAX),
    blocking. `Agreement` does the same without waiting on the network in the step.

    Must be called by every rank at the same point of every step. Without torch.distributed it
    returns `request` as is. The all-reduce runs on a CPU (gloo) group: the default group when it
    is gloo, else one of its own made at the first call (a collective), so a GPU step is never
    synchronised with the host for it; `device` is not used (scripts that pass one still work).
    The agreed request carries the highest seq and whether any rank's supervisor asked to stop;
    reason and deadline are this rank's own copy (may be empty).
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return request
    t = torch.tensor([request.seq, int(request.stop)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    return _agreed(request, int(t[0]), int(t[1]))


class Agreement:
    """All ranks agree on the supervisor's newest request without stalling a step: an all-reduce
    (MAX) of two integers on a CPU (gloo) group of its own, started at one step (`start`) and
    waited for at the next (`wait`), so that it runs while the step computes.

        agreement = Agreement()                 # after init_process_group, on every rank: a collective
        for step in ...:
            ...                                 # the step
            request = agreement.wait()          # what the ranks read one step ago, the same on every rank
            ...                                 # act on it: save, stop
            agreement.start(rt.control.poll())  # unless this was the last step

    A request is therefore acted on one step after a rank read it, at the same step on every rank
    (and so on every world size, a single process included). The costs: one more gloo group (a
    connection to every other rank, as the checkpoint engine's group has), one 16-byte all-reduce
    per step in gloo's own threads, and a step's time between the request and its save. `wait`
    returns at once unless another rank has not reached the previous step's `start`: in a job whose
    steps synchronise (gradients are all-reduced), that step ended everywhere long before.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        self._group = self._dist.new_group(backend="gloo") if self._dist is not None else None
        self._work: Any = None
        self._tensor: Any = None
        self._mine: Request | None = None  # what this rank put into the exchange in flight

    def start(self, request: Request) -> None:
        """Put this rank's newest request into an exchange (every rank, at the same step)."""
        import torch

        if self._mine is not None:
            raise RuntimeError("Agreement.start() while an exchange is in flight; wait() for it first")
        self._mine = request
        if self._dist is not None:
            self._tensor = torch.tensor([request.seq, int(request.stop)], dtype=torch.int64)
            self._work = self._dist.all_reduce(
                self._tensor, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True
            )

    def wait(self) -> Request:
        """The request the exchange in flight agreed on (NO_REQUEST when none is in flight)."""
        mine, self._mine = self._mine, None
        if mine is None:
            return NO_REQUEST
        if self._work is None:
            return mine
        work, self._work = self._work, None
        work.wait()
        return _agreed(mine, int(self._tensor[0]), int(self._tensor[1]))

    def close(self) -> None:
        """Finish the exchange in flight, if any (every rank, at the same step)."""
        self.wait()


def _agreed(mine: Request, seq: int, stop: int) -> Request:
    if stop and not mine.stop and _client is not None:  # its exit 0 then is no finished job: its supervisor rejoins
        if not _client.control.poll().stop:  # not its own supervisor's request, read by another rank first
            _client.report(**{STOPPED_ELSEWHERE_STEP: _client._step})
    if seq == mine.seq:
        return Request(seq, bool(stop), mine.reason, mine.deadline_unix)
    return Request(seq, bool(stop), "requested on another node", None)


# (the default group, the CPU group agree() and the step guard use with it)
_cpu_group_of: tuple[Any, Any] = (None, None)


def cpu_group() -> Any:
    """The default group when it is gloo, else a gloo group over the same ranks (one per default
    group, made at the first call: a collective)."""
    import torch.distributed as dist

    global _cpu_group_of
    world = dist.group.WORLD
    if _cpu_group_of[0] is not world:  # first use, or a default group destroyed and made again
        _cpu_group_of = (world, None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))
    return _cpu_group_of[1]


def _arm_parent_death_signal() -> None:
    """SIGKILL this rank when its parent dies. A rank that `ftsup run` started through its exec
    wrapper has the guard armed since before its first import; any other (the training command
    started by a shell script, say) arms it here, best effort (`ftsup.guard`)."""
    guard.arm_in_process()


# ---------------------------------------------------------------------- the process's client

_client: RuntimeClient | None = None


def runtime() -> RuntimeClient:
    """The process's client (created on first use from the environment)."""
    global _client
    if _client is None:
        _client = RuntimeClient(RuntimeEnv.from_environ())
        atexit.register(_done_at_exit)
    return _client


def _done_at_exit() -> None:
    """A rank that trained is `done` once its interpreter exits: the teardown after the script's last line (torch's,
    the interpreter's) is no silence in `train`, and torchrun's exit is what tells how it ended."""
    client = _client
    if client is not None and client.supervised and client._phase not in (Phase.INIT, Phase.DONE):
        client.beat(client._step, Phase.DONE)


def runtime_taken() -> bool:
    """Whether something in this process asked for its client (`runtime()`, `install`): the script, a Session, the
    engine or a callback. The auto-instrumentation stands down from then on (docs/design/auto-instrumentation.md)."""
    return _client is not None


def install(client: RuntimeClient) -> None:
    """Make `client` the process's client, before the training script's first `runtime()` (an adapter that
    forwards the beats elsewhere too, such as the goodput benchmark's ft_launcher rank)."""
    global _client
    _client = client
