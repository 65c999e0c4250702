"""One rank of a benchmark group: `python -m ftsup.tools.bench.checkpoint.rank SPEC.json` runs the rows the group's
spec names (`command` wrote it) on the synthetic state, over gloo, and appends one JSON line per measurement to its
results file. A row that raises is recorded and ends the process with a non-zero code: its peers may be blocked in
a collective, and the launcher stops them after a grace period.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftsup.tools.bench.checkpoint import probes, synthetic
from ftsup.tools.bench.checkpoint.ctx import Ctx, Recorder, RowFn, RowUnavailable, Trainer

ROW_FAILED_EXIT = 3


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
    from ftsup.tools.bench.checkpoint import durable_stall, ftsup_rows, hf_rows, loads, peer_rows

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
