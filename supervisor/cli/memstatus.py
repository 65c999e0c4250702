"""The memory tier as `ftsup status` shows it: its directory's use and room, the checkpoints it holds of its own
node, and the replicas of other nodes' parts (docs/cli.md, ftsup status).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.state import memview


def gather(cfg: JobConfig) -> dict[str, Any] | None:
    """The tier as `memview.read` reads it; None without one."""
    memory = cfg.checkpoint.memory
    if memory is None:
        return None
    return memview.read(Path(memory.tier(cfg.job.run_id).dir), memory.replicas, memory.keep_last)


def line(tier: dict[str, Any]) -> str:
    gib = 1 << 30
    free = f", {tier['bytes_free'] / gib:.2f} GiB free" if tier["bytes_free"] is not None else ""
    held = "; ".join(f"{n} steps {s or 'none'}" for n, s in tier["replicas"].items()) or "none"
    own = tier["steps"] or "none"
    return (
        f"memory tier {tier['dir']}: {tier['bytes_used'] / gib:.2f} GiB used{free}; own steps {own}; "
        f"replicas of peers ({tier['replicas_configured']} configured per node): {held}"
    )
