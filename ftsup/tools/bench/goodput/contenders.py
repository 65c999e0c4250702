"""The contenders of `ftsup bench goodput`: one job of the reference trainer started by `ftsup run`, by `torchrun
--standalone --max-restarts=N` (the trainer resuming by itself) or by `ft_launcher` with its heartbeat API wired in
(`nvrx_rank`), with its default or tuned timeouts. Each launcher runs behind the parent-death guard with
`TORCH_WORKAROUND`, its output in `<job root>/launcher-N.out`; an eviction is SIGTERM to it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftsup import extras
from ftsup.tools.faults.refjob import TrainerJob, child_env, start_guarded

NVRX_PACKAGE = "nvidia_resiliency_ext"
NVRX_LAUNCHER = "nvidia_resiliency_ext.fault_tolerance.launcher"  # what the `ft_launcher` script runs
NVRX_RANK = "ftsup.tools.bench.goodput.nvrx_rank"
TRAINER = "ftsup.trainer.examples.gpt"
NAMES = ("ftsup", "torchrun", "nvrx-default", "nvrx-tuned")
# With torch 2.13 and gloo, the workers a torchrun agent restarts in place now and then never get past
# init_process_group (they wait on the agent's shared rendezvous store; pytorch/pytorch#135712): a torch bug, not
# the design being measured. Every contender runs with its documented workaround (ftsup sets it for its torchrun
# by itself: docs/design/run-loop.md, The workers' store).
TORCH_WORKAROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class NvrxTimeouts:
    """ft_launcher's timeouts tuned to this job: the first heartbeat within `initial_s` of a rank's start (room for
    its imports, rendezvous and checkpoint load), then one every `heartbeat_s` (many steps' worth, with room for a
    blocking save and for a step stalled under load), checked every `check_s` (the rank monitors'
    `workload_check_interval`)."""

    initial_s: float = 60.0
    heartbeat_s: float = 3.0
    check_s: float = 1.0

    def flags(self) -> list[str]:
        return [
            f"--ft-initial-rank-heartbeat-timeout={self.initial_s:g}",
            f"--ft-rank-heartbeat-timeout={self.heartbeat_s:g}",
            f"--ft-workload-check-interval={self.check_s:g}",
        ]


@dataclass(frozen=True)
class Contender:
    name: str
    max_restarts: int
    evict_deadline_s: float
    nvrx: NvrxTimeouts | None = None  # nvrx-tuned's; None for the others

    @property
    def command(self) -> str:
        """The launcher as the table describes it."""
        if self.name == "ftsup":
            return f"ftsup run (restart.max_restarts {self.max_restarts})"
        if self.name == "torchrun":
            return f"torchrun --max-restarts={self.max_restarts}"
        flags = " ".join(self.nvrx.flags()) if self.nvrx else "default timeouts"
        return f"ft_launcher --max-restarts={self.max_restarts} {flags}"

    def missing(self, find_spec: Callable[[str], object | None] = importlib.util.find_spec) -> str | None:
        """Why this contender cannot run here (`find_spec`: where Python finds a package), or None."""
        if self.name.startswith("nvrx") and find_spec(NVRX_PACKAGE) is None:
            return "nvidia-resiliency-ext is not installed: " + extras.needs(
                ModuleNotFoundError(name=NVRX_PACKAGE), "ft_launcher"
            )
        return None

    def prepare(self, job: TrainerJob) -> None:
        job.root.mkdir(parents=True, exist_ok=True)
        if self.name == "ftsup":
            job.write_config()

    def job(self, root: Path, run_id: str, steps: int, ckpt_every: int, min_step_s: float) -> TrainerJob:
        sections: dict[str, dict[str, Any]] = {}
        if self.name == "ftsup":
            sections = {
                "restart": {"max_restarts": self.max_restarts},
                "eviction": {"default_deadline_s": self.evict_deadline_s},
            }
        return TrainerJob(root, run_id, steps, ckpt_every=ckpt_every, min_step_s=min_step_s, sections=sections)

    def argv(self, job: TrainerJob) -> list[str]:
        if self.name == "ftsup":
            return [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job.config_path)]
        launch_flags = ["--standalone", f"--nproc-per-node={job.nproc}", f"--max-restarts={self.max_restarts}"]
        if self.name == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", *launch_flags, "-m", TRAINER, *job.trainer_args()]
        flags = self.nvrx.flags() if self.nvrx else []
        return [sys.executable, "-m", NVRX_LAUNCHER, *launch_flags, *flags, "-m", NVRX_RANK, *job.trainer_args()]

    def start(self, job: TrainerJob, launch: int) -> subprocess.Popen[bytes]:
        """Launch `launch` (1 for the first; one more for each requeue after an eviction)."""
        out = job.root / f"launcher-{launch}.out"
        return start_guarded(self.argv(job), env=child_env(**TORCH_WORKAROUND), cwd=job.root, out_path=out)

    def rank_logs(self, job: TrainerJob) -> list[Path]:
        """Where this contender's ranks print (their `checkpoint_loaded duration_s=` lines among the rest)."""
        if self.name == "ftsup":
            return sorted(job.log_dir.glob("attempt-*.log"))
        return sorted(job.root.glob("launcher-*.out"))


def contenders(names: list[str], *, max_restarts: int, evict_deadline_s: float, tuned: NvrxTimeouts) -> list[Contender]:
    """The contenders named, in the table's order."""
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown contender(s) {', '.join(unknown)}: the contenders are {', '.join(NAMES)}")
    return [
        Contender(n, max_restarts, evict_deadline_s, tuned if n == "nvrx-tuned" else None) for n in NAMES if n in names
    ]
