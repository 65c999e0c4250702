"""`eviction.signals`: the signal names a config may give as eviction notices, or one `ConfigError` naming the item.

Names are stored canonical (`usr1` as `SIGUSR1`); which signals are refused, and why, is `_NOT_NOTICES`. No I/O.
"""

from __future__ import annotations

import difflib
import signal

from ftsup.supervisor.config.values import Where, describe, is_number


def signals(value: object, where: Where) -> tuple[str, ...]:
    if not isinstance(value, list):
        where.fail(f"expected a list of signal names such as [SIGTERM, SIGUSR1], got {describe(value)}")
    names: list[str] = []
    for i, item in enumerate(value):
        name = _signal_name(item, where.item(i))
        if name not in names:
            names.append(name)
    return tuple(names)


def _signal_name(value: object, where: Where) -> str:
    if not isinstance(value, str) or not value.strip():
        hint = "; use the name, since numbers differ between platforms" if is_number(value) else ""
        where.fail(f"expected a signal name such as SIGUSR1, got {describe(value)}{hint}")
    name = value.strip().upper()
    name = name if name.startswith("SIG") else "SIG" + name
    known = signal.Signals.__members__
    if name not in known:
        suggestion = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        fix = f"did you mean {suggestion[0]!r}?" if suggestion else "`kill -l` lists them"
        where.fail(f"{value!r} is not a signal on this system ({fix})")
    canonical = known[name].name  # aliases such as SIGIOT become SIGABRT
    if canonical in _NOT_NOTICES:
        alias = f" ({value!r} is another name for it)" if canonical != name else ""
        where.fail(
            f"{canonical}{alias} {_NOT_NOTICES[canonical]}, so it cannot serve as an eviction notice; use "
            "SIGTERM, SIGUSR1 or SIGUSR2"
        )
    return canonical


_UNCATCHABLE = "cannot be caught"
_FAULT = "is raised by the kernel or the process itself on a fault"
_TERMINAL = "is sent by the terminal or job control"
_TIMER = "is sent by timers"
# Signals that either never reach a handler or arrive for reasons of their own (a supervisor gets SIGCHLD every
# time one of its children exits): as eviction signals they would be missed or be false evictions.
_NOT_NOTICES = {
    **dict.fromkeys(["SIGKILL", "SIGSTOP"], _UNCATCHABLE),
    "SIGCHLD": "is sent by the kernel every time a child process exits (torchrun is one)",
    **dict.fromkeys(["SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT"], _FAULT),
    "SIGXFSZ": "is raised by the kernel when a write exceeds the file size limit",
    "SIGPIPE": "is what a shell pipeline sends when its reader goes away (`ftsup run ... | head`), and what the "
    "kernel raises on a write to a closed pipe or socket",
    **dict.fromkeys(["SIGURG", "SIGIO"], "is sent by the kernel for socket events"),
    # Sent by a terminal or a shell by habit: as notices, a keystroke or a resized window would evict the job.
    "SIGINT": "is what Ctrl-C in a terminal sends (ftsup stops the job on it, exit status 6)",
    "SIGWINCH": "is what a terminal sends whenever its window is resized",
    **dict.fromkeys(["SIGCONT", "SIGTSTP", "SIGTTIN", "SIGTTOU"], _TERMINAL),
    **dict.fromkeys(["SIGALRM", "SIGPROF", "SIGVTALRM"], _TIMER),
}
