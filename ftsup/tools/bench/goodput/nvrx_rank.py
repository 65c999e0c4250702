"""The reference trainer under NVIDIA's `ft_launcher`, with its heartbeat API wired in: a rank of `ftsup bench goodput`
(`ft_launcher ... -m ftsup.tools.bench.goodput.nvrx_rank TRAINER-ARGS`). As nvidia-resiliency-ext's guide asks, a
`RankMonitorClient` connects before training and sends one heartbeat per step, riding the trainer's own per-step
beat; the trainer runs unchanged. Needs `nvidia-resiliency-ext` (`pip install 'ftsup[bench]'`).
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
