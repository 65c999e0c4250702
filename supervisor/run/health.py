"""How many local slots (GPUs, or CPU ranks) are healthy right now: the configured command, else `nvidia-smi`, else
the configured count. A probe that fails says `unknown`, never a count it did not see (docs/design/run-loop.md,
Slot health).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass


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
    if not all(t.isdigit() for t in ids):
        raise ValueError(f"expected slot ids (integers), got {text.strip()[:200]!r}")
    return tuple(sorted({int(t) for t in ids}))


def run_health_command(argv: Sequence[str], timeout_s: float = 30.0) -> Health:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Health(None, "command", f"{argv[0]}: {e}")
    if out.returncode != 0:
        return Health(None, "command", f"{argv[0]} exited {out.returncode}: {out.stderr.strip()[:200]}")
    try:
        return Health(parse_slot_ids(out.stdout), "command")
    except ValueError as e:
        return Health(None, "command", str(e))


def nvidia_gpus(timeout_s: float = 30.0) -> Health | None:
    """Healthy GPU indices from nvidia-smi, or None when there is no nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    return run_health_command([exe, "--query-gpu=index", "--format=csv,noheader"], timeout_s)


def probe(health_command: Sequence[str] | None, nproc_per_node: int | str) -> Health:
    if health_command:
        return run_health_command(health_command)
    if nproc_per_node == "auto":
        gpus = nvidia_gpus()
        if gpus is not None:
            return gpus
        return Health(tuple(range(os.cpu_count() or 1)), "cpu")
    return Health(tuple(range(int(nproc_per_node))), "config")
