"""The ftsup save rows, run inside a rank: async and blocking saves, RSS growth.

Written against `ftsup.trainer.checkpoint.CheckpointEngine`. When that module cannot be
imported every row here (and the ftsup loads in `ftsup.tools.bench.checkpoint.loads`) reports "not
available" (the same on every rank, before any collective), so the rest still runs.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from ftsup.tools.bench.checkpoint import probes, synthetic
from ftsup.tools.bench.checkpoint.ctx import Ctx, RowFn, RowUnavailable
from ftsup.tools.bench.checkpoint.peer_rows import raw_write_once, total_bytes

# Steps are numbered per row so that retention (keep the last 3) leaves ftsup_sync's last
# save, the one the load rows read, as the newest checkpoint.
_ASYNC_STEP0 = 1_000
_RSS_STEP0 = 10_000
_SYNC_STEP0 = 100_000
KEEP_LAST = 3
_SETTLE_S = 10.0


def engine_class() -> Any:
    try:
        from ftsup.trainer.checkpoint.engine import CheckpointEngine
    except ImportError as exc:
        raise RowUnavailable(f"ftsup.trainer.checkpoint.engine is not importable: {exc}") from exc
    return CheckpointEngine


def _engine(ctx: Ctx) -> Any:
    """The engine every save row shares (collective construction, once per rank)."""
    if "engine" not in ctx.shared:
        from ftsup.trainer.checkpoint import RetentionPolicy

        cls = engine_class()
        ctx.shared["engine"] = cls(
            ctx.run_dir / "ftsup",
            max_in_flight=1,
            retention=RetentionPolicy(keep_last=KEEP_LAST),
            recycle=bool(ctx.spec.get("recycle", True)),
        )
    return ctx.shared["engine"]


def _settle(ctx: Ctx) -> None:
    """Wait (bounded) for rank 0's retention to delete old checkpoints, then sync.

    The engine applies retention after a save's future resolves, so a deletion of a whole
    checkpoint (and the discards it triggers) can overlap whatever is measured next. The
    peers' rows delete and sync between repeats; this gives ftsup's rows the same footing.
    """
    if ctx.rank == 0:
        from ftsup.store import layout

        deadline = time.monotonic() + _SETTLE_S
        root = ctx.run_dir / "ftsup"
        while len(layout.committed_dirs(root)) > KEEP_LAST and time.monotonic() < deadline:
            time.sleep(0.02)
        os.sync()
    ctx.barrier()


def _result_fields(res: Any) -> dict[str, Any]:
    return {
        "engine_stage_s": getattr(res, "stage_s", None),
        "engine_durable_s": getattr(res, "durable_s", None),
        "engine_tensor_bytes": getattr(res, "tensor_bytes", None),
    }


def ftsup_async(ctx: Ctx) -> None:
    """engine.save() then training steps until it is durable on every rank.

    With warmup, the measured saves are those of a long run's steady state: the unmeasured
    ones before them (the first reported as cold_*) are as many as the engine takes to start
    writing over recycled shard files, KEEP_LAST + 1 (retention lets the first checkpoint go
    only once the last of them committed). A run saving for days takes a handful of first
    saves and thousands of steady ones.
    """
    eng = _engine(ctx)
    total = total_bytes(ctx)
    labels: list[int | str] = []
    if ctx.spec["warmup"]:
        labels += ["warmup"] + [f"fill-{k}" for k in range(KEEP_LAST)]
    labels += list(range(ctx.repeats))
    mine = synthetic.local_bytes(ctx.syn.app.state_dict())
    for n, i in enumerate(labels):
        _settle(ctx)
        raw_s = raw_write_once(ctx, mine)
        before = ctx.trainer.time_steps(int(ctx.spec["baseline_steps"]))
        ctx.barrier()
        start = time.perf_counter()
        handle = eng.save(_ASYNC_STEP0 + n, ctx.syn.state(), kind="periodic")
        block = time.perf_counter() - start
        waiter = probes.Waiter(handle.wait, start)
        log = ctx.trainer.run_while(waiter, int(ctx.spec["steps_during"]), before)
        durable = waiter.join(float(ctx.spec["save_timeout_s"]))
        _settle(ctx)  # retention deletes an old checkpoint: not part of the unloaded steps
        log.after = ctx.trainer.time_steps(int(ctx.spec["baseline_steps"]))
        ctx.rec.record(
            "ftsup_async",
            i,
            stall_s=block + log.extra_s,
            block_s=block,
            extra_step_s=log.extra_s,
            steps_during=len(log.during),
            baseline_step_s=log.baseline_s,
            durable_s=durable,
            bytes=total,
            raw_adjacent_s=raw_s,
            **_result_fields(waiter.result),
        )
        ctx.barrier()


def ftsup_rss(ctx: Ctx) -> None:
    """RSS after N consecutive async saves (each with a step while it writes) minus before."""
    eng = _engine(ctx)
    saves = int(ctx.spec["rss_saves"])
    handle = eng.save(_RSS_STEP0, ctx.syn.state(), kind="periodic")
    handle.wait()
    gc.collect()
    before = probes.current_rss()
    start = time.perf_counter()
    for n in range(1, saves + 1):
        handle = eng.save(_RSS_STEP0 + n, ctx.syn.state(), kind="periodic")
        ctx.trainer.step()
        handle.wait()
    seconds = time.perf_counter() - start
    gc.collect()
    after = probes.current_rss()
    ctx.rec.record(
        "ftsup_rss",
        0,
        rss_before=before,
        rss_after=after,
        rss_growth_bytes=None if before is None or after is None else after - before,
        rss_saves=saves,
        wall_s=seconds,
    )


def ftsup_sync(ctx: Ctx) -> None:
    """engine.save(block=True); its last save is the one the load rows read back."""
    eng = _engine(ctx)
    total = total_bytes(ctx)
    mine = synthetic.local_bytes(ctx.syn.app.state_dict())
    for i in range(ctx.repeats):
        step = _SYNC_STEP0 + i
        _settle(ctx)
        raw_s = raw_write_once(ctx, mine)
        if i == ctx.repeats - 1:
            ref = synthetic.full_checksum(ctx.syn.app.state_dict())
            if ctx.rank == 0:
                ctx.rec.record("ftsup_sync", "reference", checksum=ref, step=step)
            ctx.shared["reference"] = {"checksum": ref, "step": step}
        ctx.barrier()
        start = time.perf_counter()
        res = eng.save(step, ctx.syn.state(), kind="final", block=True)
        ctx.barrier()
        seconds = time.perf_counter() - start
        ctx.rec.record(
            "ftsup_sync",
            i,
            stall_s=seconds,
            durable_s=seconds,
            bytes=total,
            raw_adjacent_s=raw_s,
            **_result_fields(res),
        )
    eng.wait()


ROWS: dict[str, RowFn] = {
    "ftsup_async": ftsup_async,
    "ftsup_rss": ftsup_rss,
    "ftsup_sync": ftsup_sync,
}
