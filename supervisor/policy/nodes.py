"""Whether this node may join the next attempt: the verdict of its checks, the failures put on it, and the quarantine
they lead to. Pure: values in, values out; `now` is wall-clock time, given by the caller, since a quarantine outlives
the supervisor that decided it (docs/design/policy.md, Node health and quarantine).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ftsup.supervisor.config.launch import LaunchConfig
from ftsup.supervisor.policy import failures, hangs
from ftsup.supervisor.policy.events import RankExited, RankFailure, SupervisorPhase, Tick, WorkersExited

CHECKS = ("command", "gpus", "disk_checkpoint", "disk_state", "memory")  # the `check` label's values, in order
RESULTS = ("ok", "failed", "unknown", "skipped")  # skipped: nothing to check (no GPU here, a threshold of 0)
NODE = "node"  # the quarantine's target for the node as a whole; a slot's is `slot:N`
MAX_FAULTS = 100  # failures kept per target (within the window)
MAX_TARGETS = 1025  # the node and its slots
MAX_SERVED = 64  # clear requests remembered as served
MAX_REASON_CHARS = 400

# A rank that says its peer went away failed because another node did: that failure is not this node's.
PEER_LOST = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "distnetworkerror",
    "rendezvousconnectionerror",
    "rendezvousclosederror",
    "remote process exited",
    "communicator was aborted",
    "socket timeout",
)
# Process states that put a hang on the rank's own node: stopped, in uninterruptible sleep, or gone (a rank blocked
# in a collective sleeps, `S`, and may wait for another node).
LOCAL_HANG_STATES = {**hangs.STUCK, **hangs.BLOCKED}


# ---------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    name: str  # one of CHECKS
    result: str  # one of RESULTS
    detail: str = ""


@dataclass(frozen=True)
class Verdict:
    """The node's checks as a whole. `healthy`: True when every check passed or had nothing to check, False when one
    failed (the node does not join), None when none failed but one was blind (it joins; a blind probe is never
    taken for a pass)."""

    healthy: bool | None
    checks: tuple[Check, ...]

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.result == "failed")

    @property
    def reason(self) -> str:
        """`disk_checkpoint: 0.2 GiB free in /ckpt, below 1 GiB; command: exited 1: "no GPU 3"` (the failed checks,
        else the blind ones; empty when all passed)."""
        shown = self.failed or tuple(c for c in self.checks if c.result == "unknown")
        return "; ".join(f"{c.name}: {c.detail}" if c.detail else c.name for c in shown)[:MAX_REASON_CHARS]


def verdict(checks: Sequence[Check]) -> Verdict:
    results = {c.result for c in checks}
    healthy = False if "failed" in results else None if "unknown" in results else True
    return Verdict(healthy, tuple(checks))


# ---------------------------------------------------------------------- failures put on this node


@dataclass(frozen=True)
class NodeFault:
    """A failure put on this node (`faults`): one of its ranks crashed, not for a lost peer, or was stopped or stuck
    when the attempt failed. The quarantine counts it (`record`)."""

    attempt: int
    local_rank: int | None  # the slot it ran on; None: the node as a whole
    reason: str


def slot(local_rank: int | None) -> str:
    return NODE if local_rank is None else f"slot:{local_rank}"


def peer_lost(output: Sequence[str]) -> bool:
    """Whether a rank's last lines say that a peer went away (the cause is another node's)."""
    tail = " ".join(line.lower() for line in output[-failures.MAX_LINES :])
    return any(words in tail for words in PEER_LOST)


def _fault_of(attempt: int, f: RankFailure) -> NodeFault | None:
    if f.exitcode == -signal.SIGTERM or peer_lost(f.output) or failures.startup_error(f.output):
        return None  # stopped by torchrun, failed for a lost peer, or a command that cannot start anywhere
    return NodeFault(attempt, f.local_rank, failures.how(f))


def faults(
    phase_before: SupervisorPhase, phase_after: SupervisorPhase, attempt: int | None, ev: object
) -> list[NodeFault]:
    """The failures the policy's step on `ev` put on this node: fed, like the goodput accountant, the phase before and
    after it and the attempt that ran. A crash of one of its ranks (torchrun's first observed failure, or a rank seen
    dead) unless it was stopped by torchrun or its last lines say a peer went away; a hang found while one of its
    ranks was stopped, in uninterruptible sleep or gone. Torchrun's own failure (a rendezvous) names no rank: none."""
    if attempt is None or phase_before != SupervisorPhase.RUNNING or phase_after == SupervisorPhase.RUNNING:
        return []
    if isinstance(ev, WorkersExited) and ev.attempt == attempt and ev.exitcode != 0:
        ranked = failures.culprits(ev.failures)
        fault = _fault_of(attempt, ranked[0]) if ranked else None
        return [fault] if fault is not None else []
    if isinstance(ev, RankExited) and ev.attempt == attempt and not (ev.exitcode == 0 and not ev.signal):
        f = ev.failure or RankFailure(None, pid=ev.pid, exitcode=ev.exitcode)
        if ev.signal and f.exitcode is None:
            f = replace(f, exitcode=-ev.signal)
        fault = _fault_of(attempt, f)
        return [fault] if fault is not None else []
    if isinstance(ev, Tick):
        stuck = sorted(rank for rank, state in ev.states if state in LOCAL_HANG_STATES)
        if stuck:
            state = LOCAL_HANG_STATES[dict(ev.states)[stuck[0]]]
            return [NodeFault(attempt, stuck[0], f"local rank {stuck[0]} was {state} when the attempt failed")]
    return []


# ---------------------------------------------------------------------- quarantine


@dataclass(frozen=True)
class Rules:
    failures: int  # failures within the window that quarantine a target; 0: never
    window_s: float
    quarantine_s: float

    @classmethod
    def of(cls, cfg: LaunchConfig) -> Rules:
        return cls(cfg.quarantine_after, cfg.quarantine_window_s, cfg.quarantine_s)


@dataclass(frozen=True)
class Entry:
    target: str  # NODE or `slot:N`
    faults: tuple[float, ...] = ()  # when each failure counted now was put on it (unix), oldest first
    until: float | None = None  # quarantined until then (unix); None: not quarantined
    reason: str = ""  # the newest failure put on it
    quarantines: int = 0  # how often it was quarantined


@dataclass(frozen=True)
class Book:
    """What the quarantine remembers: an entry per target, and the ids of the clear requests served."""

    entries: tuple[Entry, ...] = ()
    served: tuple[str, ...] = ()

    def get(self, target: str) -> Entry | None:
        return next((e for e in self.entries if e.target == target), None)

    def put(self, entry: Entry) -> Book:
        rest = tuple(e for e in self.entries if e.target != entry.target)
        return replace(self, entries=tuple(sorted((*rest, entry), key=lambda e: (e.target != NODE, e.target))))


def record(rules: Rules, book: Book, fault: NodeFault, now: float) -> tuple[Book, Entry, bool]:
    """Count `fault` against its slot and against the node (a node is as good as its worst slot); returns the book,
    the node's entry, and whether the node is quarantined by it (its failures within the window reached
    `rules.failures`: they are used up by the quarantine, which lasts `rules.quarantine_s`). A slot's count is kept
    for the operator (`ftsup nodes`): the world size is counted in slots, not pinned to devices, so a slot is never
    held out on its own."""
    reason = fault.reason[:MAX_REASON_CHARS]
    if fault.local_rank is not None:
        book = book.put(_counted(book.get(slot(fault.local_rank)) or Entry(slot(fault.local_rank)), rules, now, reason))
    node = _counted(book.get(NODE) or Entry(NODE), rules, now, reason)
    held = node.until is not None and node.until > now
    if not held and rules.failures > 0 and len(node.faults) >= rules.failures:
        node = replace(node, faults=(), until=now + rules.quarantine_s, quarantines=node.quarantines + 1)
        return book.put(node), node, True
    return book.put(node), node, False


def _counted(entry: Entry, rules: Rules, now: float, reason: str) -> Entry:
    recent = tuple(t for t in entry.faults if now - t < rules.window_s)
    return replace(entry, faults=(*recent, now)[-MAX_FAULTS:], reason=reason)


def held(book: Book, now: float) -> Entry | None:
    """The node's quarantine in force at `now`, or None."""
    node = book.get(NODE)
    return node if node is not None and node.until is not None and node.until > now else None


def expire(book: Book, now: float) -> tuple[Book, Entry | None]:
    """End a quarantine whose time is up: (the book, the entry it ended, or None)."""
    node = book.get(NODE)
    if node is None or node.until is None or node.until > now:
        return book, None
    return book.put(replace(node, until=None)), node


def clear(book: Book, request_id: str | None, slots: Sequence[int] | None = None) -> tuple[Book, list[str]]:
    """An operator's clear: every target (`slots` None) or those slots; their failures and quarantine forgotten.
    Returns the book and the targets cleared; a request id already served clears nothing again."""
    if request_id is not None and request_id in book.served:
        return book, []
    wanted = None if slots is None else {slot(s) for s in slots}
    gone = [e.target for e in book.entries if wanted is None or e.target in wanted]
    kept = tuple(e for e in book.entries if e.target not in gone)
    served = book.served if request_id is None else (*book.served, request_id)[-MAX_SERVED:]
    return Book(kept, served), gone


def counts(book: Book, now: float, rules: Rules) -> Mapping[str, int]:
    """Each target's failures within the window, as of `now`."""
    return {e.target: sum(1 for t in e.faults if now - t < rules.window_s) for e in book.entries}
