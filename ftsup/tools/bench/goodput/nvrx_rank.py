"""The reference trainer under NVIDIA's `ft_launcher`, with its heartbeat API wired in: a rank of `ftsup bench goodput`.

    ft_launcher --standalone --nproc-per-node 2 --max-restarts N -m ftsup.tools.bench.goodput.nvrx_rank TRAINER-ARGS

nvidia-resiliency-ext's heartbeat integration (its guide "Heartbeats API Integration" and its example
`train_ddp_heartbeats_api.py`) asks three things of a training script: a `RankMonitorClient` on each rank,
connected with `init_workload_monitoring()` before training; `send_heartbeat()` once per training step; and
`shutdown_workload_monitoring()` at the end. The timeouts stay whatever `ft_launcher` was given (its defaults
or its `--ft-*-timeout` flags); the optional steps of that guide (timeouts computed from observed intervals, the
client's state kept in the checkpoint) are left out, so that the two rows of the benchmark differ only in the
timeouts their command lines give.

The per-step call rides the trainer's own per-step heartbeat: this process's ftsup runtime client (not under a
supervisor here, so it sends nothing itself) is replaced, before the trainer asks for it, by one that also sends
ft_launcher's heartbeat after each beat in phase `train` (one per optimizer step and one after each save, never
during a load or a save, as that guide says). The trainer itself (`ftsup.trainer.examples.gpt`) is run
unchanged, flags and all: the same model, data, checkpoints and loss log as under `ftsup run` and torchrun.

Tooling, never imported by the product; it needs `nvidia-resiliency-ext` (`pip install 'ftsup[bench]'`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ftsup.protocol import Phase, RuntimeEnv
from ftsup.trainer import runtime as runtime_module
from ftsup.trainer.runtime import RuntimeClient


class HeartbeatingClient(RuntimeClient):
    """ftsup's runtime client that also sends ft_launcher's heartbeat after every beat in phase `train`.

    `monitor` is a connected `RankMonitorClient` (anything with `send_heartbeat()`). Its errors are not
    caught: a rank whose monitor is gone fails, as the guide's example does."""

    def __init__(self, env: RuntimeEnv, monitor: Any) -> None:
        super().__init__(env)
        self.monitor = monitor
        self.heartbeats = 0

    def beat(self, step: int, phase: Phase | str | None = None, **figures: float | int | str) -> None:
        super().beat(step, phase, **figures)
        if phase == Phase.TRAIN:  # a str enum: "train" too
            self.monitor.send_heartbeat()
            self.heartbeats += 1


def main(argv: list[str] | None = None) -> int:
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    from ftsup.trainer.examples import gpt

    monitor = RankMonitorClient()
    monitor.init_workload_monitoring()
    # Installed before the trainer's first `runtime()`, which then returns it (one client per process).
    runtime_module.install(HeartbeatingClient(RuntimeEnv.from_environ(), monitor))
    try:
        return gpt.main(argv)
    finally:
        monitor.shutdown_workload_monitoring()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the trainer's own __main__ does: no interpreter teardown of torch
