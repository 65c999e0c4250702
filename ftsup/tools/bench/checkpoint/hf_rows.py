"""The Hugging Face rows, run inside the ranks of group `hf`: a blocking ftsup save of the synthetic state, its
export to the Hub's layout (`hf_export`, beside a raw write of the same bytes) and the imports from it (`hf_import`,
`dcp_hf_import`, interleaved), each checked bitwise against the saved state's checksum. Names, figures and
targets: `hf_report`; the export and import themselves: `ftsup.trainer.hf`.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ftsup import guard
from ftsup.tools.bench.checkpoint import loads, probes, synthetic
from ftsup.tools.bench.checkpoint.ctx import Ctx, RowFn
from ftsup.tools.bench.checkpoint.hf_report import IMPORT_ROWS
from ftsup.tools.bench.checkpoint.peer_rows import RAW_BLOCK, DirectIOUnsupported, write_file


def hf(ctx: Ctx) -> list[str]:
    wanted = list(ctx.spec["hf_rows"])
    if "dcp_hf_import" in wanted and not hasattr(dcp, "HuggingFaceStorageReader"):  # the same on every rank
        ctx.rec.record(
            "dcp_hf_import",
            None,
            status="not available",
            error=f"this torch ({torch.__version__}) has no HuggingFaceStorageReader",
        )
        wanted.remove("dcp_hf_import")
    root = ctx.run_dir / "hf"
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    reference = synthetic.full_checksum(ctx.syn.model.state_dict())
    _save(ctx, root / "ckpt")
    out = _exports(ctx, root, "hf_export" in wanted)
    imports = [n for n in IMPORT_ROWS if n in wanted]
    if imports:
        _imports(ctx, out, reference, imports)
    return wanted


def _save(ctx: Ctx, path: Path) -> None:
    from ftsup.tools.bench.checkpoint.ftsup_rows import engine_class  # the import check lives there

    with engine_class()(path, max_in_flight=1) as eng:
        eng.save(1, ctx.syn.state(), block=True)


# --------------------------------------------------------------------------- export


def _exports(ctx: Ctx, root: Path, measured: bool) -> Path:
    out = root / "export"
    shard = int(ctx.spec["hf_max_shard_bytes"])
    buf = mmap.mmap(-1, RAW_BLOCK)
    buf.write(os.urandom(2**20) * (RAW_BLOCK // 2**20))
    nbytes = 0
    repeats = ctx.repeats if measured else 1
    try:
        for i in range(repeats):
            ctx.barrier()
            if ctx.rank == 0:
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                raw_s = None
                if i % 2 and nbytes:  # the raw write first every other repeat
                    raw_s = _raw_write(root / "raw.bin", nbytes, buf)
                dropped = probes.drop_page_cache()
                got = _export_child(ctx, root / "ckpt", out, shard, root / f"export-{i}.json")
                nbytes = got["bytes"]
                if raw_s is None:
                    raw_s = _raw_write(root / "raw.bin", nbytes, buf)
                if measured:
                    kept = ("peak_rss_bytes", "largest_shard_bytes", "shards", "export_base_rss_bytes")
                    figures = {k: got[k] for k in kept}
                    ctx.rec.record(
                        "hf_export",
                        i,
                        durable_s=got["export_s"],
                        bytes=nbytes,
                        raw_adjacent_s=raw_s,
                        cache_dropped=dropped,
                        **figures,
                    )
            ctx.barrier()
    finally:
        buf.close()
    return out


def _raw_write(path: Path, nbytes: int, buf: mmap.mmap) -> float | None:
    """The faster of a buffered and an O_DIRECT sequential write of `nbytes` (each fsynced), in seconds."""
    best = None
    for direct in (False, True):
        try:
            seconds = write_file(path, nbytes, direct, buf)
        except DirectIOUnsupported:
            continue
        finally:
            path.unlink(missing_ok=True)
            os.sync()
        best = seconds if best is None else min(best, seconds)
    return best


def _export_child(ctx: Ctx, ckpt: Path, out: Path, shard: int, result: Path) -> dict[str, Any]:
    """Run the export in a child (dying with this rank); what it measured of itself (`hf_child`)."""
    command = [
        sys.executable,
        "-m",
        "ftsup.tools.bench.checkpoint.hf_child",
        str(ckpt),
        str(out),
        str(shard),
        str(result),
    ]
    guarded, guard_env = guard.wrap(command)
    log = ctx.run_dir / "hf" / "export.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            guarded, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **guard_env}
        )
    try:
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if code != 0:
        raise RuntimeError(f"the export exited with {code}:\n{log.read_text(errors='replace')[-2000:]}")
    got: dict[str, Any] = json.loads(result.read_text())
    return got


# --------------------------------------------------------------------------- import


def _imports(ctx: Ctx, out: Path, reference: str | None, names: list[str]) -> None:
    by_name = {"hf_import": lambda: _hf_load(ctx, out), "dcp_hf_import": lambda: _dcp_load(ctx, out)}
    for i in range(ctx.repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            _import_once(ctx, name, by_name[name], reference, i)


def _hf_load(ctx: Ctx, out: Path) -> Any:
    from ftsup.trainer.hf.load import load_hf_model

    return load_hf_model(ctx.syn.model, out)


def _dcp_load(ctx: Ctx, out: Path) -> None:
    # FSDP2's state dict is its parameters (DTensors): DCP loads into their local shards in place.
    reader = dcp.HuggingFaceStorageReader(str(out))
    dcp.load(ctx.syn.model.state_dict(), storage_reader=reader, process_group=ctx.dcp_pg)


def _import_once(ctx: Ctx, name: str, load: Callable[[], Any], reference: str | None, repeat: int) -> None:
    loads.measure_load(
        ctx, loads.LoadCase(name, reference, load), repeat, ctx.syn.model.state_dict, per_rank_ratios=True
    )


ROWS: dict[str, RowFn] = {"hf": hf}
