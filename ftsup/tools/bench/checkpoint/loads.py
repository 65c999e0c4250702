"""Load rows, run inside a rank: cold-cache loads into zeroed state, checked bitwise. `ftsup_load_same` loads on the
world size that saved; `reshard_loads` runs `dcp_load_reshard` and `ftsup_load_reshard` on another, interleaved
repeat by repeat in alternating order, so that the disk's drift over a run falls on both alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp

from ftsup.tools.bench.checkpoint import probes, synthetic
from ftsup.tools.bench.checkpoint.ctx import Ctx, RowFn, RowUnavailable


@dataclass(frozen=True)
class LoadCase:
    name: str
    reference: str | None  # checksum of the full state when it was saved
    load: Callable[[], Any]  # loads into ctx.syn in place; may return a result with bytes_read


def run_loads(ctx: Ctx, cases: list[LoadCase]) -> list[str]:
    """Each repeat: every case once (order alternating), into zeroed state, cold cache.

    The first repeat also checks that zeroing changed the checksum, so that "exact" cannot
    come from a load that did nothing.
    """
    for i in range(ctx.repeats):
        for case in cases if i % 2 == 0 else cases[::-1]:
            _load_once(ctx, case, i)
    return [c.name for c in cases]


def _load_once(ctx: Ctx, case: LoadCase, repeat: int) -> None:
    measure_load(ctx, case, repeat, ctx.syn.app.state_dict)


def measure_load(
    ctx: Ctx, case: LoadCase, repeat: int, state_dict: Callable[[], dict[str, Any]], *, per_rank_ratios: bool = False
) -> None:
    """One measured load of `case` into the state `state_dict()` gives, zeroed first, from a dropped cache: time,
    bytes read (the disk's and the kernel's count), peak RSS, bitwise exact; `per_rank_ratios` also records each
    rank's bytes read over its share."""
    sd = state_dict()
    synthetic.zero_(sd)
    perturbed = None
    if repeat == 0:
        zeroed = synthetic.full_checksum(sd)
        perturbed = zeroed != case.reference if ctx.rank == 0 else None
    del sd
    dropped = ctx.drop_cache()
    probes.trim_heap()
    rss_start = probes.current_rss()
    probes.reset_peak_rss()
    before = probes.io_counters()
    start = time.perf_counter()
    result = case.load()
    seconds = time.perf_counter() - start
    after = probes.io_counters()
    peak = probes.peak_rss()
    ctx.barrier()
    got = synthetic.full_checksum(state_dict())
    share = synthetic.local_bytes(state_dict())
    read, rchar = probes.io_delta(before, after, "read_bytes"), probes.io_delta(before, after, "rchar")
    ratios = {}
    if per_rank_ratios:
        ratios = {
            "rank_bytes_read_vs_share": None if read is None or not share else read / share,
            "rank_rchar_vs_share": None if rchar is None or not share else rchar / share,
        }
    ctx.rec.record(
        case.name,
        repeat,
        load_s=seconds,
        bytes_read=read,
        rchar=rchar,
        needed_bytes=share,
        engine_bytes_read=getattr(result, "bytes_read", None),
        **ratios,
        exact=(got == case.reference and perturbed is not False) if ctx.rank == 0 else None,
        perturbed=perturbed,
        cache_dropped=dropped,
        peak_rss_bytes=peak,
        peak_rss_increase_bytes=None if peak is None or rss_start is None else peak - rss_start,
    )


def _engine(ctx: Ctx) -> Any:
    """A new engine on the store, as a restarted job would have (collective)."""
    from ftsup.tools.bench.checkpoint.ftsup_rows import KEEP_LAST, engine_class  # the import check lives there
    from ftsup.trainer.checkpoint import RetentionPolicy

    return engine_class()(ctx.run_dir / "ftsup", max_in_flight=1, retention=RetentionPolicy(keep_last=KEEP_LAST))


def _ftsup_case(ctx: Ctx, name: str, eng: Any, reference: dict[str, Any]) -> LoadCase:
    state, step = ctx.syn.state(), int(reference["step"])
    return LoadCase(name, reference["checksum"], lambda: eng.load(state, step=step))


def _dcp_case(ctx: Ctx, name: str, reference: dict[str, Any]) -> LoadCase:
    state, path = ctx.syn.state(), reference["path"]
    return LoadCase(name, reference["checksum"], lambda: dcp.load(state, checkpoint_id=path, process_group=ctx.dcp_pg))


def ftsup_load_same(ctx: Ctx) -> list[str]:
    """Load ftsup_sync's last checkpoint on the world size that wrote it."""
    if "engine" in ctx.shared:
        ctx.shared.pop("engine").close()
    reference = ctx.shared.get("reference")
    if reference is None:
        raise RowUnavailable("ftsup_sync did not run, so there is no checkpoint to load")
    eng = _engine(ctx)
    try:
        return run_loads(ctx, [_ftsup_case(ctx, "ftsup_load_same", eng, reference)])
    finally:
        eng.close()


def reshard_loads(ctx: Ctx) -> list[str]:
    """dcp_load_reshard and ftsup_load_reshard (those the spec names), interleaved."""
    wanted = list(ctx.spec["reshard_loads"])
    refs = ctx.spec["references"]
    cases: list[LoadCase] = []
    eng = None
    if "ftsup_load_reshard" in wanted:
        try:
            eng = _engine(ctx)
        except RowUnavailable as exc:
            ctx.rec.record("ftsup_load_reshard", None, status="not available", error=str(exc))
        else:
            cases.append(_ftsup_case(ctx, "ftsup_load_reshard", eng, refs["ftsup"]))
    if "dcp_load_reshard" in wanted:
        cases.append(_dcp_case(ctx, "dcp_load_reshard", refs["dcp"]))
    try:
        return run_loads(ctx, cases)
    finally:
        if eng is not None:
            eng.close()


ROWS: dict[str, RowFn] = {
    "ftsup_load_same": ftsup_load_same,
    "reshard_loads": reshard_loads,
}
