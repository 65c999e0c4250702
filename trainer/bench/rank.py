"""One rank of a benchmark group: `python -m ftsup.trainer.bench.rank SPEC.json`.

Reads the group's spec (written by `ftsup.trainer.bench.checkpoint`), initialises gloo from the
environment the launcher set, builds the synthetic state, runs the rows the spec names in
order, and appends one JSON line per measurement to its results file. A row that raises
is recorded and ends the process with a non-zero code: its peers may be blocked in a
collective, and the launcher stops them after a grace period.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftsup.trainer.bench import probes, synthetic

ROW_FAILED_EXIT = 3


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


def choose_step(syn: synthetic.Synthetic, spec: dict[str, Any]) -> tuple[str, int, float | None]:
    """("model" | "matmul", matmul repeats, measured model step s) agreed by all ranks."""
    kind = spec["step_kind"]
    model_s = None
    if kind in ("auto", "model"):
        syn.model_step()
        times = synthetic.time_calls(syn.model_step, 2)
        model_s = max(times)
        if kind == "auto":
            kind = "model" if model_s <= spec["max_model_step_s"] else "matmul"
    repeats = spec.get("matmul_repeats") or synthetic.MatmulStep.calibrate(spec["step_ms"] / 1e3)
    t = torch.tensor([repeats, 1 if kind == "model" else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # same work on every rank; rank 0's choice wins
    return ("model" if t[1].item() else "matmul"), int(t[0].item()), model_s


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = Recorder(Path(spec["results_dir"]) / f"{spec['phase']}-rank{rank}.jsonl", rank)
    try:
        shape = synthetic.ModelShape(**spec["shape"])
        syn = synthetic.build(shape, world)
        kind, matmul_repeats, model_s = choose_step(syn, spec)
        step = syn.model_step if kind == "model" else synthetic.MatmulStep(matmul_repeats)
        trainer = Trainer(step, float(spec["save_timeout_s"]))
        dcp_pg = dist.new_group(backend="gloo")
        ctx = Ctx(rank, world, spec, rec, syn, trainer, dcp_pg, Path(spec["run_dir"]))
        baseline = statistics.median(trainer.time_steps(int(spec["baseline_steps"])))
        sd = syn.app.state_dict()
        rec.record(
            "_config",
            None,
            step_kind=kind,
            matmul_repeats=matmul_repeats,
            model_step_s=model_s,
            baseline_step_s=baseline,
            local_bytes=synthetic.local_bytes(sd),
            rss=probes.current_rss(),
            world_size=world,
            torch_version=torch.__version__,
        )
        del sd
        _run_rows(ctx)
        dist.barrier()
    finally:
        rec.close()
    dist.destroy_process_group()
    return 0


def _run_rows(ctx: Ctx) -> None:
    from ftsup.trainer.bench import durable_stall, ftsup_rows, hf_rows, loads, peer_rows

    table: dict[str, RowFn] = {**peer_rows.ROWS, **ftsup_rows.ROWS, **loads.ROWS, **hf_rows.ROWS, **durable_stall.ROWS}
    for name in ctx.spec["rows"]:
        gc.collect()
        probes.trim_heap()
        ctx.barrier()
        rss_start = probes.current_rss()
        probes.reset_peak_rss()
        start = time.perf_counter()
        try:
            done = table[name](ctx) or [name]
        except RowUnavailable as exc:
            ctx.rec.record(name, None, status="not available", error=str(exc))
            continue
        except Exception as exc:  # adapter boundary: record, then end this rank
            ctx.rec.record(
                name,
                None,
                status="error",
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
            )
            ctx.rec.close()
            sys.stdout.flush()
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(ROW_FAILED_EXIT)
        ctx.barrier()
        peak = probes.peak_rss()
        for row in done:
            ctx.rec.record(
                row,
                None,
                status="ok",
                peak_rss=peak,
                rss_increase=None if peak is None or rss_start is None else peak - rss_start,
                wall_s=time.perf_counter() - start,
            )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
