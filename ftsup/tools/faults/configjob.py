"""`ftsup chaos --config JOB.yaml`: the faults thrown at a job of one's own instead of the reference trainer. Its
config is read and validated as `ftsup run` reads it, and the job runs twice (uninterrupted, then faulted), each run
with a run id, a state directory and a store of its own; what the job must do for the checks: docs/chaos.md.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftsup.tools.faults.refjob import TrainerJob

NEEDS_REFERENCE_TRAINER = {
    "exit-rank": "needs the reference trainer's --fault-file (not run with --config)",
    "kill-in-commit": "needs the reference trainer's --fault-file (not run with --config)",
    "node-loss": "the two-node job is the reference trainer's (not run with --config)",
}


@dataclass(frozen=True)
class ConfigJob(TrainerJob):
    """A job of one's own, in `root`: `base_config` is its config with every default filled in
    (`JobConfig.to_dict()`); `user_loss_log` where it appends its loss log."""

    base_config: dict[str, Any] = field(default_factory=dict)
    user_loss_log: Path = Path("loss.jsonl")
    sample_pattern: str | None = None

    @property
    def loss_log(self) -> Path:
        return self.user_loss_log

    def config(self) -> dict[str, Any]:
        cfg = copy.deepcopy(self.base_config)
        cfg.pop("source", None)
        cfg["job"].update(run_id=self.run_id, state_dir=str(self.state_dir))
        cfg["launch"]["rdzv_id"] = self.run_id
        cfg["checkpoint"]["dir"] = str(self.ckpt_dir)
        cfg["logging"]["dir"] = str(self.log_dir)
        for name, values in self.sections.items():
            cfg.setdefault(name, {}).update(values)
        return cfg

    def collect(self) -> None:
        """Move what the run appended to the job's own files into `root` (loss.jsonl, samples-R.jsonl)."""
        if self.user_loss_log.exists():
            os.replace(self.user_loss_log, self.root / "loss.jsonl")
        for rank, path in sample_logs(self.sample_pattern):
            os.replace(path, self.root / f"samples-{rank}.jsonl")


def sample_logs(pattern: str | None) -> list[tuple[int, Path]]:
    """The per-rank files a `{rank}` pattern names that exist now, with their rank."""
    if not pattern or "{rank}" not in pattern:
        return []
    where = Path(pattern).parent
    head, _, tail = Path(pattern).name.partition("{rank}")
    name = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + r"\Z")
    out = []
    try:
        entries = list(os.scandir(where))
    except FileNotFoundError:
        return []
    for e in entries:
        m = name.match(e.name)
        if m and e.is_file(follow_symlinks=False):
            out.append((int(m.group(1)), Path(e.path)))
    return sorted(out)
