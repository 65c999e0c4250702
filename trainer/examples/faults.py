"""The reference trainer's faults (`--fault`, `--fault-file`): processes that fail, and numbers that go wrong.

Their flags: docs/adopting.md, The reference trainer; when each acts: docs/design/trainer.md, The examples.
"""

from __future__ import annotations

import math
import os
import signal
import stat
import time
from dataclasses import dataclass

import torch

from ftsup.store import safefile
from ftsup.store.errors import CheckpointError
from ftsup.trainer.rng import derive_seed

PROCESS_FAULTS = ("kill", "kill-in-save", "exit", "stop")
TRIGGERED = ("exit", "kill-in-commit")  # the kinds a --fault-file asks for
COMMIT_POINTS = ("shard_written", "metadata_written", "manifest_written")  # the engine's hook points
TRIGGER_MAX_BYTES = 4096
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


class Trigger:
    """`--fault-file PATH`: one process fault asked for from outside while the run goes on.

    The file (replaced atomically by the asker) holds `{"pid": P, "kind": K}`, and for `kill-in-commit`
    `"point"`, one of COMMIT_POINTS. Only the process whose pid is P acts on it, and once, so a file
    left behind means nothing to the ranks of a later attempt. It is read with one `stat()` per step
    and again only when it changed; a file that is not a small regular file of that schema is ignored
    (it comes from outside the process), since a test knob must never stop the run it tests.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._point = ""  # kill-in-commit: the commit point at which to die
        self._served = False

    def poll(self) -> str:
        """The fault to inject before this step ("exit"), or "" (nothing, or one armed for the next save)."""
        if not self.path or self._served:
            return ""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return ""
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._seen or not stat.S_ISREG(st.st_mode) or st.st_size > TRIGGER_MAX_BYTES:
            return ""
        self._seen = key
        asked = _read_small_json(self.path)
        if asked is None or asked.get("pid") != os.getpid():
            return ""
        kind, point = asked.get("kind"), asked.get("point", "")
        if kind not in TRIGGERED or (kind == "kill-in-commit" and point not in COMMIT_POINTS):
            return ""
        self._served = True
        if kind == "kill-in-commit":
            self._point = str(point)
            return ""
        return str(kind)

    def kills_at(self, point: str) -> bool:
        """Whether the save's hook at `point` is where this rank was asked to die."""
        return bool(self._point) and point == self._point


def _read_small_json(path: str) -> dict[str, object] | None:
    """The file's JSON object as the store reads its files (`safefile`: no link, regular, capped, depth-checked),
    or None for anything else."""
    try:
        doc = safefile.read_json(path, "--fault-file", TRIGGER_MAX_BYTES)
    except CheckpointError:
        return None
    return doc if isinstance(doc, dict) else None
