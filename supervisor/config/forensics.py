"""`forensics:` the evidence a hang leaves behind: every rank's stacks and state, captured before the kill.

`ForensicsConfig` is the section, `parse_forensics` reads it or raises one `ConfigError` naming the key; no I/O. What
is captured and how: docs/incidents.md, Hangs: the evidence before the kill.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from ftsup.supervisor.config import values as config_values
from ftsup.supervisor.config.values import Section, Where

TOOLS = ("pystack", "py-spy")  # the stack tools ftsup knows how to run, as their programs are named
MAX_TIMEOUT_S = 60.0
MAX_KEEP = 10_000


@dataclass(frozen=True)
class ForensicsConfig:
    """`forensics:` what the supervisor captures before it stops a hung attempt, and how many records it keeps."""

    enabled: bool = True
    """Capture evidence (every rank's stacks, process state, last heartbeat and log lines, NCCL's flight recorder)
    before a hung attempt is stopped, and keep an incident record of it (`ftsup incidents`). False: stop at once."""
    timeout_s: float = 3.0
    """The longest a capture may take; past it the attempt is stopped with what was captured by then."""
    tools: tuple[str, ...] = TOOLS
    """The stack tools to try, in order, for each rank: `pystack` or `py-spy`, found on PATH or beside the
    interpreter ftsup runs under, or a path to one of them. The next is tried when one is missing or fails; with
    none left, a rank's evidence is its process state and kernel wait channel. Empty: no stack tool."""
    keep: int = 50
    """Incident records kept in `<job.state_dir>/incidents/`; the oldest beyond this are deleted."""
    on_straggler: bool = True
    """Capture the stacks (without stopping anything) when a rank is reported as a straggler."""
    nccl_flight_recorder: bool = True
    """Have torch's NCCL flight recorder record the ranks' collectives and dump them, on a hang, into the incident
    (TORCH_NCCL_TRACE_BUFFER_SIZE and its kin, each unless `job.env` or the environment sets it)."""


def parse_forensics(sec: Section) -> ForensicsConfig:
    return ForensicsConfig(
        enabled=sec.optional("enabled", config_values.boolean),
        timeout_s=sec.optional("timeout_s", config_values.number(low=0.1, low_ok=True, high=MAX_TIMEOUT_S)),
        tools=sec.optional("tools", tools),
        keep=sec.optional("keep", config_values.integer(1, MAX_KEEP)),
        on_straggler=sec.optional("on_straggler", config_values.boolean),
        nccl_flight_recorder=sec.optional("nccl_flight_recorder", config_values.boolean),
    )


def tools(value: object, where: Where) -> tuple[str, ...]:
    names = config_values.string_list(value, where, example="[pystack, py-spy]")
    for i, name in enumerate(names):
        if PurePath(name).name not in TOOLS:
            where.item(i).fail(f"{name!r} is not one of {', '.join(TOOLS)} (or a path to one of them)")
    return names
