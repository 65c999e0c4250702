"""The reference trainer's faults (`--fault`): processes that fail, and numbers that go wrong.

Process faults, on rank `--fault-rank`, in attempt `--fault-attempt` only (so that a restart gets
past them): `kill@STEP` (SIGKILL after step STEP), `kill-in-save@STEP` (SIGKILL in the background
writer while step STEP's checkpoint is written), `exit@STEP` (exit status 3 after step STEP),
`stop@STEP` (SIGSTOP after step STEP: a hang), `slow@RANK:FACTOR` (every micro-batch of rank RANK
takes FACTOR times as long, from the first step on: a straggler that keeps beating, not a hang;
its peers wait for it, so it shows in the `compute_s` figure, not in `step_s`).

Data faults are keyed to global data *positions*, the positions the schedule without skips serves
at the steps named, and are there in every attempt, as bad data would be: a run that skips those
positions (a rollback's data skip, `FTSUP_DATA_SKIPS`) never meets them, and one that does not
meets them again. `nan@STEP[:RANK]`: a micro-batch of rank RANK (default `--fault-rank`) holding
one of step STEP's positions has a NaN loss. `spike@STEP:LEN`: the samples at the positions of
steps STEP..STEP+LEN-1 are random tokens (drawn from the run's seed and the position) and the loss
of a micro-batch holding one is scaled by SPIKE_LOSS_SCALE, on every rank: the loss goes far up
until they are skipped.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass

import torch

from ftsup.trainer.rng import derive_seed

PROCESS_FAULTS = ("kill", "kill-in-save", "exit", "stop")
SPIKE_LOSS_SCALE = 10.0
USAGE = (
    "--fault must be KIND@STEP with KIND kill, kill-in-save, exit or stop, nan@STEP[:RANK], spike@STEP:LEN or "
    "slow@RANK:FACTOR (FACTOR >= 1)"
)


@dataclass(frozen=True)
class Fault:
    kind: str = ""
    step: int = -1  # the process fault's step, or the first poisoned step
    rank: int = -1  # the rank it happens on (-1: every rank, as for spike)
    length: int = 0  # spike: poisoned steps
    factor: float = 1.0  # slow

    def process_fault(self, rank: int) -> tuple[str, int]:
        """(kind, step) of a process fault on `rank`, or ("", -1)."""
        return (self.kind, self.step) if self.kind in PROCESS_FAULTS and rank == self.rank else ("", -1)


def parse(spec: str, fault_rank: int, attempt: int, fault_attempt: int) -> Fault:
    """`--fault` as a Fault; SystemExit naming the forms it takes when it is none of them.
    Process faults (slow included) outside attempt `fault_attempt` (-1: every one) are none."""
    if not spec:
        return Fault()
    kind, _, at = spec.partition("@")
    first, _, second = at.partition(":")
    try:
        if kind in PROCESS_FAULTS and at.isdigit():
            fault = Fault(kind, int(at), fault_rank)
        elif kind == "nan" and first.isdigit() and (not second or second.isdigit()):
            return Fault("nan", int(first), int(second) if second else fault_rank)
        elif kind == "spike" and first.isdigit() and second.isdigit() and int(second) >= 1:
            return Fault("spike", int(first), -1, int(second))
        elif kind == "slow" and first.isdigit() and math.isfinite(float(second)) and float(second) >= 1:
            fault = Fault("slow", 1, int(first), factor=float(second))
        else:
            raise ValueError(spec)
    except ValueError:
        raise SystemExit(f"{USAGE}; got {spec!r}") from None
    if fault_attempt >= 0 and attempt not in (0, fault_attempt):
        return Fault()
    return fault


def inject(kind: str) -> int | None:
    """A process fault, after its step: an exit status to return, or nothing (a signal)."""
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stop":  # a hang: alive, silent, holding its peers
        os.kill(os.getpid(), signal.SIGSTOP)
    return 3 if kind == "exit" else None


class Poison:
    """The data faults of one rank: what its micro-batches' tokens and losses become."""

    def __init__(self, fault: Fault, global_batch: int, seed: int, rank: int) -> None:
        self.kind = fault.kind if fault.kind in ("nan", "spike") and fault.rank in (-1, rank) else ""
        self.slow = fault.factor if fault.kind == "slow" and fault.rank == rank else 1.0
        self.seed = seed
        steps = fault.length if fault.kind == "spike" else 1
        self.first, self.end = (fault.step - 1) * global_batch, (fault.step - 1 + steps) * global_batch

    def hit(self, positions: tuple[int, ...]) -> list[int]:
        """Which of a micro-batch's rows are at poisoned positions."""
        return [i for i, p in enumerate(positions) if self.kind and self.first <= p < self.end]

    def tokens(self, positions: tuple[int, ...], tokens: torch.Tensor) -> torch.Tensor:
        rows = self.hit(positions) if self.kind == "spike" else []
        if not rows:
            return tokens
        tokens = tokens.clone()
        for i in rows:
            g = torch.Generator().manual_seed(derive_seed(self.seed, "spike", positions[i]))
            tokens[i] = torch.randint(0, 256, tokens[i].shape, generator=g, dtype=tokens.dtype)
        return tokens

    def loss(self, positions: tuple[int, ...], loss: torch.Tensor) -> torch.Tensor:
        if not self.hit(positions):
            return loss
        return loss * (math.nan if self.kind == "nan" else SPIKE_LOSS_SCALE)

    def slow_down(self, took_s: float) -> None:
        """A straggler: this rank's micro-batch, which took `took_s`, takes `factor` times as long."""
        if self.slow > 1.0:
            time.sleep((self.slow - 1.0) * took_s)
