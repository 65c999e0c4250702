"""How a failed attempt is told to the operator: which rank, its exit code or the signal by name, its last lines.

Pure: values in, text and log fields out; a rank's output is only quoted, never acted on (docs/design/policy.md,
Telling a failure).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from typing import Any

from ftsup.supervisor.policy.events import RankExited, RankFailure, WorkersExited

MAX_LINES = 20  # of a rank's output, in an event
TAIL_LINES = 200  # of a rank's output, read to find its traceback
MAX_LINE_CHARS = 400
MAX_DETAILED = 8  # failures listed one by one in an event (torchrun may report every rank of a large node)

_HINTS = {
    "SIGKILL": "out of memory, or kill -9",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a bad memory access",
    "SIGABRT": "aborted by native code",
}
_EXCEPTION = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)(?::|$)")
_STARTUP = re.compile(
    r"(?:ModuleNotFoundError|ImportError): .*|No module named .*|can't open file .*|Error while finding module .*"
)


def signal_name(exitcode: int | None) -> str | None:
    """`SIGKILL` for -9 (how Popen and torchrun report a death by signal); None for an exit or a number no
    signal has."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return None


def traceback_end(output: Sequence[str]) -> str | None:
    """The line that ends the last traceback in `output` (`ValueError: boom`), None when there is none. When the
    tail read began inside a long traceback, its header is gone: then the last line that reads as an exception."""
    starts = [i for i, line in enumerate(output) if line.startswith("Traceback (most recent call last)")]
    for line in output[starts[-1] + 1 :] if starts else ():
        if line.strip() and not line[0].isspace():
            return line.strip()[:MAX_LINE_CHARS]
    found = next((line for line in reversed(output) if _EXCEPTION.match(line)), None)
    return None if found is None else found.strip()[:MAX_LINE_CHARS]


def exception_line(output: Sequence[str]) -> str | None:
    """The line that ends the last traceback in `output`, else the last non-empty line."""
    found = traceback_end(output)
    return found or next((line.strip()[:MAX_LINE_CHARS] for line in reversed(output) if line.strip()), None)


def startup_error(output: Sequence[str]) -> str | None:
    """The part of the last line that says the command could not start: an import that failed (in the
    training script, or torch missing under the interpreter that runs torchrun) or a script not found."""
    last = exception_line(output)
    found = _STARTUP.search(last) if last else None
    return found.group(0)[:MAX_LINE_CHARS] if found else None


def how(f: RankFailure) -> str:
    """`rank 1 (pid 4242) was killed by SIGKILL`, `rank 0 (pid 77) exited with code 1`."""
    who = "a rank" if f.rank is None else f"rank {f.rank}"
    if f.pid is not None:
        who += f" (pid {f.pid})"
    if f.exitcode is None:
        return f"{who} ended; its exit status was not reported"
    sig = signal_name(f.exitcode)
    if sig is not None:
        return f"{who} was killed by {sig}" + (f" ({_HINTS[sig]})" if sig in _HINTS else "")
    if f.exitcode > 128 and signal_name(128 - f.exitcode):  # a shell reports its child's signal as 128 + N
        return f"{who} exited with code {f.exitcode} (a shell's {signal_name(128 - f.exitcode)})"
    return f"{who} exited with code {f.exitcode}"


def _said(f: RankFailure) -> str:
    """`how`, with its cause: the traceback's last line (`: ValueError: boom`), or the signal that killed it (what it
    printed last, a warning as often as not, is no cause); else the last line of its output, marked as no cause."""
    end = traceback_end(f.output)
    if end:
        return f"{how(f)}: {end}"
    if signal_name(f.exitcode) is not None:
        return how(f)
    return how(f) + _uncaused(f.output)


def _uncaused(output: Sequence[str]) -> str:
    """What ends a failure's reason when neither a traceback nor a signal tells its cause."""
    last = exception_line(output)
    return f"; no traceback; last line: {last}" if last else "; no traceback, no output"


def culprits(failures: Sequence[RankFailure]) -> list[RankFailure]:
    """The failures in the order to tell them: torchrun's first observed one, then deaths by a signal other
    than the SIGTERM with which torchrun stops the others, then the rest."""

    def order(f: RankFailure) -> tuple[int, int]:
        stopped = f.exitcode == -signal.SIGTERM
        return (
            0 if f.root else 1 if signal_name(f.exitcode) and not stopped else 2 if not stopped else 3,
            f.rank if f.rank is not None else 1 << 30,
        )

    return sorted(failures, key=order)


def exited_reason(ev: WorkersExited) -> str:
    """Why torchrun's exit failed the attempt, in one line."""
    ranked = culprits(ev.failures)
    if not ranked:
        sig = signal_name(ev.exitcode)
        end = traceback_end(ev.output)
        if sig:
            return f"torchrun was killed by {sig}" + (f": {end}" if end else "")
        return f"torchrun exited with code {ev.exitcode}" + (f": {end}" if end else _uncaused(ev.output))
    # The others torchrun stopped with SIGTERM once the first had failed are no news; any other failure is.
    others = [f for f in ranked[1:] if f.exitcode != -signal.SIGTERM]
    if not others:
        return _said(ranked[0])
    more = ", ".join(how(f) for f in others[:2]) + (", ..." if len(others) > 2 else "")
    return f"{_said(ranked[0])} (and {len(others)} other rank(s): {more})"


def rank_exited(ev: RankExited) -> tuple[str, dict[str, Any]]:
    """The reason and the event's fields for a rank that died while torchrun had not yet reported it."""
    f = ev.failure or RankFailure(None, pid=ev.pid, exitcode=ev.exitcode)
    if ev.signal and f.exitcode is None:
        f = RankFailure(f.rank, f.local_rank, f.pid, -ev.signal, f.output)
    return _said(f), fields([f], (), None)


def fields(failures: Sequence[RankFailure], output: Sequence[str], log: str | None) -> dict[str, Any]:
    """The event's fields for a failure: `rank`, `exit_code`, `signal`, `output` (the last lines of the rank's
    output, or of torchrun's own when no rank is named) of the culprit, `log` (the attempt's log file) and
    `failures` (each rank torchrun reported, at most `MAX_DETAILED`)."""
    out: dict[str, Any] = {}
    ranked = culprits(failures)
    if log is not None:
        out["log"] = log
    if ranked:
        first = ranked[0]
        out.update(
            rank=first.rank, exit_code=first.exitcode, signal=signal_name(first.exitcode), output=_bounded(first.output)
        )
        if len(ranked) > 1:
            out["failures"] = [
                {
                    "rank": f.rank,
                    "local_rank": f.local_rank,
                    "pid": f.pid,
                    "exit_code": f.exitcode,
                    "signal": signal_name(f.exitcode),
                    "last_line": exception_line(f.output),
                }
                for f in ranked[:MAX_DETAILED]
            ]
    elif output:
        out["output"] = _bounded(output)
    return out


def exited_fields(ev: WorkersExited, log: str | None) -> dict[str, Any]:
    out = fields(ev.failures, ev.output, log)
    if not ev.failures:
        out.update(exit_code=ev.exitcode, signal=signal_name(ev.exitcode))
    return out


def startup_failure(ev: WorkersExited) -> str | None:
    """`rank 0: ModuleNotFoundError: No module named 'x'` when the attempt ended because the command could not
    start (the culprit's output, or torchrun's own when it named no rank, ends that way); else None."""
    ranked = culprits(ev.failures)
    if ranked:
        why = startup_error(ranked[0].output)
        return None if why is None else (f"rank {ranked[0].rank}: {why}" if ranked[0].rank is not None else why)
    why = startup_error(ev.output)
    return None if why is None else f"torchrun: {why}"


def crash_loop_reason(streak: int, last: str, cannot_start: str | None) -> str:
    """The reason `ftsup run` gives up with exit status 3, the cause of the last failure in it."""
    if cannot_start:
        return f"the training command cannot start: {cannot_start} (not retried: it would fail the same way)"
    return f"crash loop: {streak} attempts in a row made no step progress (last failure: {last})"


def _bounded(lines: Sequence[str]) -> list[str]:
    return [line[:MAX_LINE_CHARS] for line in lines[-MAX_LINES:]]
