"""What a benchmark row gets: the rank's context (`Ctx`: group, synthetic state, recorder), and its signature."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftsup.tools.bench.checkpoint import probes, synthetic


class RowUnavailable(Exception):
    """Raised identically on every rank, before any collective, when a row cannot run."""


class Recorder:
    """Appends measurements as JSON lines; flushed at once so a killed rank keeps them."""

    def __init__(self, path: Path, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)
        self._rank = rank

    def record(self, row: str, repeat: int | str | None, **fields: Any) -> None:
        line = {"row": row, "rank": self._rank, "repeat": repeat, **fields}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Trainer:
    """Runs training steps; every step ends with a one-int all-reduce so ranks stop together.

    The all-reduce is part of every step (baseline and during a save alike): it keeps a
    step that uses collectives in lockstep, and it makes a rank wait for a slower peer,
    which is the stall a synchronous training job sees.
    """

    def __init__(self, step: Callable[[], None], timeout_s: float) -> None:
        self.step = step
        self.timeout_s = timeout_s

    def _any(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def time_steps(self, count: int) -> list[float]:
        """Durations of `count` (at least one) steps with no save in flight."""
        times = []
        for _ in range(max(1, count)):
            start = time.perf_counter()
            self.step()
            self._any(False)
            times.append(time.perf_counter() - start)
        return times

    def run_while(self, waiter: probes.Waiter, min_steps: int, before: list[float]) -> probes.StepLog:
        """Step until every rank's save is done (and at least `min_steps` steps ran); the
        caller adds the `after` steps once whatever follows the save has settled."""
        log = probes.StepLog(before)
        deadline = time.perf_counter() + self.timeout_s
        count = 0
        while True:
            pending = not waiter.done()
            start = time.perf_counter()
            self.step()
            anyone = self._any(not waiter.done())
            if pending:
                log.during.append(time.perf_counter() - start)
            count += 1
            if count >= min_steps and not anyone:
                return log
            if time.perf_counter() > deadline:
                raise TimeoutError(f"a background save was still running after {self.timeout_s}s")


@dataclass
class Ctx:
    """What a row function gets: this rank, the spec, the state, and where to write."""

    rank: int
    world: int
    spec: dict[str, Any]
    rec: Recorder
    syn: synthetic.Synthetic
    trainer: Trainer
    dcp_pg: Any  # a dedicated gloo group: DCP's background thread must not share ours
    run_dir: Path
    shared: dict[str, Any] = field(default_factory=dict)  # passed between rows

    @property
    def repeats(self) -> int:
        return int(self.spec["repeats"])

    def barrier(self) -> None:
        dist.barrier()

    def drop_cache(self) -> bool:
        """Rank 0 drops the page cache between barriers; every rank learns whether it worked."""
        self.barrier()
        ok = probes.drop_page_cache() if self.rank == 0 else True
        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.broadcast(t, src=0)
        self.barrier()
        return bool(t.item())


# A row function returns the names of the rows it measured when that is not just its own
# (one function can interleave two rows), or None.
RowFn = Callable[[Ctx], "list[str] | None"]
