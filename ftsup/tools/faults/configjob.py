"""`ftsup chaos --config JOB.yaml`: the faults thrown at a job of one's own instead of the reference trainer.

The job's config is read and validated as `ftsup run` would (every default filled in, every relative
path resolved against the file's directory) and runs twice under `ftsup run`: as the uninterrupted
reference, and as the faulted job, each with a run id, a state directory (its logs in it) and a
checkpoint store of its own in the work directory, the faulted one with the chaos run's restart
budget and eviction settings on top. What the checks need of the job:

- it stores its checkpoints with ftsup's engine in `checkpoint.dir` (`FTSUP_CHECKPOINT_DIR`), not
  in a directory its command names;
- `--loss-log FILE`: the file it appends one JSON line per optimizer step to, as the reference
  trainer does (`step`, `loss`, `world_size`; `loss_hex`, `float.hex(loss)`, compares bitwise,
  else `loss` as written); it must not exist before the run, and is moved into the work directory
  after each run;
- `--sample-log PATTERN` (optional; `{rank}` in it stands for the rank): each rank's sample ids,
  one JSON line per step (`step`, `rank`, `world_size`, `ids`); without it samples are not checked;
- `--ckpt-every K`: its periodic checkpoint interval in steps, at which some faults are aimed.

The kinds that need the reference trainer itself are not run: `exit-rank` and `kill-in-commit`
(its `--fault-file`) and `node-loss` (the two-node job is built from its flags).
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
