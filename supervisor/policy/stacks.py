"""What the ranks' stacks say, pure: a stack tool's output read into threads and frames, whether a rank waits inside
a collective, which ranks share a stack, and the rank the evidence blames (docs/incidents.md, Naming the culprit).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ftsup.supervisor.policy.hangs import BLOCKED, STUCK

MAX_THREADS = 64  # threads kept per rank (a process with thousands is cut here, and says so)
MAX_FRAMES = 128  # frames kept per thread, the innermost ones
MAX_FRAME_CHARS = 300  # a C++ symbol can run to thousands of characters of template arguments
NATIVE = "[native] "  # how a native (C/C++) frame begins; a Python frame is `function (file:line)`

# A frame inside a collective or a wait for one: torch.distributed's Python API, or its C++ side (the process group,
# gloo and NCCL, DDP's reducer waiting for its gradient all-reduce at the end of backward).
_COLLECTIVE_PY = re.compile(r"\(.*torch/distributed/(?!elastic/)[^()]*:\d+\)")
_COLLECTIVE_NATIVE = re.compile(r"c10d::|gloo::|\bnccl[A-Z]\w*|ProcessGroup(Gloo|NCCL)|Reducer::")
_ADDRESS = re.compile(r"0x[0-9a-f]+( \(.*\))?")  # a native frame the tool could not name: differs by process

_PYSPY_THREAD = re.compile(r'Thread (?P<tid>0x[0-9a-fA-F]+|\d+) \((?P<status>[^)]*)\)(?:: "(?P<name>.*)")?$')
_PYSPY_PY = re.compile(r"(?P<fn>.+) \((?P<file>.+):(?P<line>\d+)\)$")
_PYSTACK_THREAD = re.compile(r"Traceback for thread (?P<tid>\d+) \((?P<name>[^)]*)\) \[(?P<flags>[^\]]*)\]")
_PYSTACK_PY = re.compile(r'\(Python\) File "(?P<file>.*)", line (?P<line>\d+), in (?P<fn>.+)$')
_PYSTACK_C = re.compile(r'\(C\) File "(?P<file>.*)", line (?P<line>\d+), in (?P<fn>.+?)(?: \((?P<lib>[^()]*)\))?$')


@dataclass(frozen=True)
class Thread:
    """One thread's stack, outermost frame first (a traceback's order)."""

    name: str
    tid: int | None
    main: bool  # the process's main thread (its tid is the pid)
    frames: tuple[str, ...]
    status: str = ""  # what the tool said of it (py-spy: idle, active, gil)
    cut: bool = False  # frames beyond MAX_FRAMES left out

    def signature(self) -> tuple[str, tuple[str, ...]]:
        """What two ranks' threads share when they are in the same place: its role and its named frames."""
        return ("main" if self.main else self.name), tuple(f for f in self.frames if not _unnamed(f))


def _unnamed(frame: str) -> bool:
    return frame.startswith(NATIVE) and _ADDRESS.fullmatch(frame[len(NATIVE) :]) is not None


def clean(text: str) -> str:
    """A frame's text: printable, one line, capped (the names come from the rank's memory, whatever it holds)."""
    text = "".join(c if c.isprintable() else "?" for c in text.strip())
    return text if len(text) <= MAX_FRAME_CHARS else text[: MAX_FRAME_CHARS - 3] + "..."


def _thread(name: str, tid: int | None, pid: int, frames: list[str], status: str = "") -> Thread:
    cut = len(frames) > MAX_FRAMES
    return Thread(clean(name)[:64], tid, tid == pid, tuple(frames[-MAX_FRAMES:]), status[:32], cut)


def _tid(text: str) -> int | None:
    try:
        return int(text, 16) if text.startswith("0x") else int(text)
    except ValueError:
        return None


def parse_pystack(text: str, pid: int) -> list[Thread]:
    """`pystack remote --native-last PID`'s output: each thread's traceback, most recent call last."""
    threads: list[Thread] = []
    head: tuple[str, int | None] | None = None
    frames: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if m := _PYSTACK_THREAD.match(line):
            if head is not None:
                threads.append(_thread(head[0], head[1], pid, frames))
            head, frames = (m["name"], _tid(m["tid"])), []
        elif head is None:
            continue
        elif m := _PYSTACK_PY.match(line):
            frames.append(clean(f"{m['fn']} ({m['file']}:{m['line']})"))
        elif m := _PYSTACK_C.match(line):
            lib = f" ({m['lib'].rsplit('/', 1)[-1]})" if m["lib"] else ""
            frames.append(clean(f"{NATIVE}{m['fn']}{lib}"))
        elif line and frames and raw.startswith("        ") and not frames[-1].startswith(NATIVE):
            frames[-1] = clean(f"{frames[-1]}: {line}")  # the source line of the Python frame above
    if head is not None:
        threads.append(_thread(head[0], head[1], pid, frames))
    return threads[:MAX_THREADS]


def parse_pyspy(text: str, pid: int) -> list[Thread]:
    """`py-spy dump --pid PID`'s output (with `--native` or not): each thread's frames, innermost first, turned
    into a traceback's order."""
    threads: list[Thread] = []
    head: tuple[str, int | None, str] | None = None
    frames: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if m := _PYSPY_THREAD.match(line):
            if head is not None:
                threads.append(_thread(head[0], head[1], pid, frames[::-1], head[2]))
            head, frames = (m["name"] or "", _tid(m["tid"]), m["status"]), []
        elif head is None or not line or not raw.startswith("    "):
            continue
        elif m := _PYSPY_PY.match(line):
            frames.append(clean(f"{m['fn']} ({m['file']}:{m['line']})"))
        else:
            frames.append(clean(NATIVE + line))
    if head is not None:
        threads.append(_thread(head[0], head[1], pid, frames[::-1], head[2]))
    for i, t in enumerate(threads):  # py-spy names the main thread; its id may be the thread's, not the pid
        if t.name == "MainThread" and not any(u.main for u in threads):
            threads[i] = Thread(t.name, t.tid, True, t.frames, t.status, t.cut)
    return threads[:MAX_THREADS]


def in_collective(threads: Sequence[Thread]) -> bool | None:
    """Whether the rank waits inside a collective: its main thread (else any thread) has a frame of
    torch.distributed or of its process groups. None when no thread has a frame to judge by."""
    judged = [t for t in threads if t.main and t.frames] or [t for t in threads if t.frames]
    if not judged:
        return None
    return any(_collective(f) for t in judged for f in t.frames)


def _collective(frame: str) -> bool:
    if frame.startswith(NATIVE):
        return _COLLECTIVE_NATIVE.search(frame) is not None
    return _COLLECTIVE_PY.search(frame) is not None


def group(stacks: Iterable[tuple[int, Sequence[Thread]]]) -> list[tuple[tuple[int, ...], Sequence[Thread]]]:
    """Ranks with the same stacks (every thread by its role and named frames) together: (their ranks, one of their
    stacks), the largest group first, then by their first rank. A rank with no stack is a group of its own."""
    groups: dict[object, tuple[list[int], Sequence[Thread]]] = {}
    for rank, threads in stacks:
        key: object = tuple(sorted(t.signature() for t in threads)) if threads else ("none", rank)
        groups.setdefault(key, ([], threads))[0].append(rank)
    return sorted(((tuple(sorted(r)), t) for r, t in groups.values()), key=lambda g: (-len(g[0]), g[0]))


@dataclass(frozen=True)
class Seen:
    """A rank as the capture saw it: its process state (a /proc/PID/stat letter, or `hangs.GONE`) and whether its
    stack waits inside a collective (None: no stack)."""

    rank: int
    state: str | None
    collective: bool | None


def culprit(ranks: Sequence[Seen], blamed: int | None, *, by_silence: bool = True) -> tuple[int | None, str]:
    """The rank the evidence blames, and why: a rank whose process runs nothing (stopped, gone), then one in
    uninterruptible sleep, then a rank outside any collective while others wait inside one (the one the policy
    blamed among them, else the lowest); for a hang (`by_silence`), then a rank running while others sleep, then the
    rank the policy blamed (silent first). (None, why) when nothing tells the ranks apart."""
    for table in (STUCK, BLOCKED):
        hit = [r.rank for r in ranks if r.state in table]
        if hit:
            rank = blamed if blamed in hit else min(hit)
            state = next(r.state for r in ranks if r.rank == rank)
            return rank, table[state or ""]
    known = [r for r in ranks if r.collective is not None]
    outside = sorted(r.rank for r in known if not r.collective)
    inside = sorted(r.rank for r in known if r.collective)
    if outside and inside:
        rank = blamed if blamed in outside else outside[0]
        return rank, f"not inside a collective, while {ranks_text(inside)} {'is' if len(inside) == 1 else 'are'}"
    running = sorted(r.rank for r in ranks if r.state == "R")
    sleeping = sorted(r.rank for r in ranks if r.state == "S")
    if by_silence and running and sleeping:  # a hang: the rank that runs is not the one waiting (gloo waits asleep)
        rank = blamed if blamed in running else running[0]
        return rank, f"running (state R) while {ranks_text(sleeping)} {'waits' if len(sleeping) == 1 else 'wait'}"
    if by_silence and blamed is not None:
        return blamed, "silent first (its stack did not tell it from the others')"
    return None, "no rank stopped, blocked or outside a collective while others waited in one"


def ranks_text(ranks: Iterable[int]) -> str:
    """`rank 3`, or `ranks 0-5, 7`: ranks as a person reads them."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return ("rank " if runs and runs[0][0] == runs[-1][1] else "ranks ") + ", ".join(parts)
