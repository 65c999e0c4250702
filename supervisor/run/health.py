"""How many local slots (GPUs, or CPU ranks) are healthy right now: the configured command, else `nvidia-smi`, else
the configured count. A probe that fails says `unknown`, never a count it did not see; what a command prints is
capped and quoted (docs/design/run-loop.md, Slot health).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from ftsup.supervisor.run import capped

MAX_SLOTS = 1024  # slot ids a health command may name


@dataclass(frozen=True)
class Health:
    slots: tuple[int, ...] | None  # healthy slot ids; None = unknown
    source: str
    detail: str = ""

    @property
    def count(self) -> int | None:
        return None if self.slots is None else len(self.slots)


def parse_slot_ids(text: str) -> tuple[int, ...]:
    ids = [tok for tok in re.split(r"[\s,]+", text.strip()) if tok]
    if len(ids) > MAX_SLOTS or not all(t.isdigit() and len(t) <= 6 for t in ids):
        raise ValueError(f"expected at most {MAX_SLOTS} slot ids (integers), got {text.strip()[:200]!r}")
    return tuple(sorted({int(t) for t in ids}))


def from_command(ran: capped.Ran, what: str) -> Health:
    """The slots a health command's run names (`what`: how it is named in a message); unknown when it failed or
    printed something else (quoted, never more)."""
    if ran.code is None:
        return Health(None, "command", f"{what}: {ran.why}")
    if ran.code != 0:
        return Health(None, "command", f"{what} exited {ran.code}: {capped.quote(ran.err or ran.out)}")
    try:
        return Health(parse_slot_ids(ran.out.decode("utf-8", "replace")), "command")
    except ValueError:
        return Health(None, "command", f"{what} printed {capped.quote(ran.out)}, not slot ids")


def nvidia_gpus(timeout_s: float = 30.0) -> Health | None:
    """Healthy GPU indices from nvidia-smi, or None when there is no nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    return from_command(capped.run([exe, "--query-gpu=index", "--format=csv,noheader"], timeout_s), "nvidia-smi")


def probe(ran: capped.Ran | None, nproc_per_node: int | str, timeout_s: float = 30.0) -> Health:
    """The healthy slots: those `ran` (how `launch.health_command` ran, None: there is none) names, else nvidia-smi's
    GPUs for "auto", else the configured count."""
    if ran is not None:
        return from_command(ran, "launch.health_command")
    if nproc_per_node == "auto":
        gpus = nvidia_gpus(timeout_s)
        if gpus is not None:
            return gpus
        return Health(tuple(range(os.cpu_count() or 1)), "cpu")
    return Health(tuple(range(int(nproc_per_node))), "config")
