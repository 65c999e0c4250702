"""The reference rows, run inside a rank: `raw_write` and `memcpy` bound what any checkpointer can do on this
machine; `torch_save`, `dcp_save`, `dcp_async` and `dcp_async_process` are the peers ftsup's saves are compared
with (their loads: `loads`). Each writes under its own folder of the run directory.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.tensor import DTensor

from ftsup.tools.bench.checkpoint import probes, synthetic
from ftsup.tools.bench.checkpoint.ctx import Ctx, RowFn

RAW_BLOCK = 64 * 2**20
DIRECT_ALIGN = 4096


class DirectIOUnsupported(Exception):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, nbytes: int, direct: bool, buf: mmap.mmap) -> float:
    """Write `nbytes` sequentially in 64 MiB blocks and fsync; seconds taken.

    With O_DIRECT the buffer is an anonymous mmap (page-aligned) and the last block is
    rounded up to 4 KiB, so up to 4 KiB more than `nbytes` is written.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        flags |= os.O_DIRECT
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            raise DirectIOUnsupported(str(exc)) from exc
        raise
    view = memoryview(buf)
    try:
        start = time.perf_counter()
        remaining = nbytes
        while remaining > 0:
            n = min(len(buf), remaining)
            if direct:
                n = min(len(buf), -(-n // DIRECT_ALIGN) * DIRECT_ALIGN)
            done = 0
            while done < n:
                try:
                    done += os.write(fd, view[done:n])
                except OSError as exc:
                    if direct and exc.errno == errno.EINVAL:
                        raise DirectIOUnsupported(str(exc)) from exc
                    raise
            remaining -= n
        os.fsync(fd)
        _fsync_dir(path.parent)
        return time.perf_counter() - start
    finally:
        view.release()
        os.close(fd)


def raw_write(ctx: Ctx) -> None:
    """Each rank writes its share of the state's bytes, all ranks at once, both ways."""
    nbytes = synthetic.local_bytes(ctx.syn.app.state_dict())
    folder = ctx.run_dir / "raw_write"
    folder.mkdir(parents=True, exist_ok=True)
    buf = mmap.mmap(-1, RAW_BLOCK)
    buf.write(os.urandom(2**20) * (RAW_BLOCK // 2**20))
    path = folder / f"rank{ctx.rank}.bin"
    for mode in ("buffered", "direct"):
        for i in range(ctx.repeats):
            ctx.drop_cache()
            try:
                seconds: float | None = write_file(path, nbytes, mode == "direct", buf)
                error = None
            except DirectIOUnsupported as exc:
                seconds, error = None, f"O_DIRECT unsupported here: {exc}"
            ctx.barrier()
            path.unlink(missing_ok=True)
            ctx.rec.record(f"raw_write.{mode}", i, durable_s=seconds, bytes=nbytes, error=error)
    buf.close()


def raw_write_once(ctx: Ctx, nbytes: int) -> float | None:
    """One more raw write of `nbytes` per rank (O_DIRECT where possible), all ranks at once.

    For rows that want the disk's speed measured next to their own writes.
    """
    if "raw_buf" not in ctx.shared:
        buf = mmap.mmap(-1, RAW_BLOCK)
        buf.write(os.urandom(2**20) * (RAW_BLOCK // 2**20))
        ctx.shared["raw_buf"] = buf
    folder = ctx.run_dir / "raw_write"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"adjacent-rank{ctx.rank}.bin"
    ctx.barrier()
    try:
        seconds = write_file(path, nbytes, True, ctx.shared["raw_buf"])
    except DirectIOUnsupported:
        seconds = write_file(path, nbytes, False, ctx.shared["raw_buf"])
    ctx.barrier()
    path.unlink(missing_ok=True)
    os.sync()
    ctx.barrier()
    return seconds


def _hugepage_views(src: list[torch.Tensor]) -> list[torch.Tensor]:
    """One anonymous mapping (huge pages asked for, faulted in) cut into a view per tensor."""
    offsets, total = [], 0
    for t in src:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64
    area = mmap.mmap(-1, max(total, 1))
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass  # no THP: plain pages, still warm after the first copy
    flat = torch.frombuffer(area, dtype=torch.uint8)
    flat.fill_(0)
    return [
        flat[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for o, t in zip(offsets, src, strict=True)
    ]


def _copy_s(dst: list[torch.Tensor], src: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
    return time.perf_counter() - start


def memcpy(ctx: Ctx) -> None:
    """Copy the rank's local state into warm, pre-allocated buffers: the staging limit.

    Two kinds of buffer, the faster one counts: one tensor per source (ordinary pages) and
    one huge-page mapping (fewer TLB misses; what a staging buffer can use).
    """
    src = synthetic.local_tensors(ctx.syn.app.state_dict())
    plain = [torch.empty_like(t) for t in src]
    huge = _hugepage_views(src)
    _copy_s(plain, src)
    _copy_s(huge, src)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    for i in range(ctx.repeats):
        ctx.barrier()
        plain_s = _copy_s(plain, src)
        ctx.barrier()
        huge_s = _copy_s(huge, src)
        best = min(plain_s, huge_s)
        ctx.rec.record(
            "memcpy",
            i,
            stall_s=best,
            copy_s=best,
            copy_plain_s=plain_s,
            copy_hugepage_s=huge_s,
            bytes=nbytes,
        )


def _remove(ctx: Ctx, path: Path) -> None:
    """Rank 0 removes a finished save and syncs; nobody moves on until that is done.

    Without the barrier the next repeat's baseline steps would wait on rank 0's deletion
    (and the filesystem's discards), inflating the baseline and hiding the stall.
    """
    ctx.barrier()
    if ctx.rank == 0:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        os.sync()
    ctx.barrier()


def torch_save(ctx: Ctx) -> None:
    """Rank 0 gathers every full tensor and writes one torch.save file, then fsyncs it."""
    folder = ctx.run_dir / "torch_save"
    folder.mkdir(parents=True, exist_ok=True)
    total = total_bytes(ctx)
    for i in range(ctx.repeats):
        path = folder / f"rep{i}.pt"
        ctx.barrier()
        start = time.perf_counter()
        full: dict[str, Any] = {}
        for key, leaf in synthetic.iter_leaves(ctx.syn.app.state_dict()):
            value = leaf.full_tensor() if isinstance(leaf, DTensor) else leaf
            if ctx.rank == 0:
                full[key] = value
        if ctx.rank == 0:
            with open(path, "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(folder)
        del full
        ctx.barrier()
        seconds = time.perf_counter() - start
        ctx.rec.record("torch_save", i, stall_s=seconds, durable_s=seconds, bytes=total)
        _remove(ctx, path)


def total_bytes(ctx: Ctx) -> int:
    """State bytes over all ranks (recorded by rank 0 only, so sums stay right)."""
    t = torch.tensor([synthetic.local_bytes(ctx.syn.app.state_dict())], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item()) if ctx.rank == 0 else 0


def dcp_save(ctx: Ctx) -> None:
    """torch.distributed.checkpoint.save; the last repeat stays for dcp_load_reshard."""
    folder = ctx.run_dir / "dcp_save"
    total = total_bytes(ctx)
    for i in range(ctx.repeats):
        last = i == ctx.repeats - 1
        if last:
            ref = synthetic.full_checksum(ctx.syn.app.state_dict())
            if ctx.rank == 0:
                ctx.rec.record("dcp_save", "reference", checksum=ref, path=str(folder / f"rep{i}"))
        ctx.barrier()
        start = time.perf_counter()
        dcp.save(ctx.syn.state(), checkpoint_id=folder / f"rep{i}", process_group=ctx.dcp_pg)
        ctx.barrier()
        seconds = time.perf_counter() - start
        ctx.rec.record("dcp_save", i, stall_s=seconds, durable_s=seconds, bytes=total)
        if not last:
            _remove(ctx, folder / f"rep{i}")


def _async_row(ctx: Ctx, name: str, kind: AsyncCheckpointerType) -> None:
    folder = ctx.run_dir / name
    total = total_bytes(ctx)
    for i in ["warmup", *range(ctx.repeats)] if ctx.spec["warmup"] else range(ctx.repeats):
        before = ctx.trainer.time_steps(int(ctx.spec["baseline_steps"]))
        ctx.barrier()
        start = time.perf_counter()
        ret = dcp.async_save(
            ctx.syn.state(),
            checkpoint_id=folder / f"rep{i}",
            process_group=ctx.dcp_pg,
            async_checkpointer_type=kind,
        )
        block = time.perf_counter() - start
        # A Future, or (with a zero-overhead stager) an AsyncSaveResponse holding one.
        future = ret.upload_completion if isinstance(ret, AsyncSaveResponse) else ret
        waiter = probes.Waiter(future.result, start)
        log = ctx.trainer.run_while(waiter, int(ctx.spec["steps_during"]), before)
        durable = waiter.join(float(ctx.spec["save_timeout_s"]))
        log.after = ctx.trainer.time_steps(int(ctx.spec["baseline_steps"]))
        ctx.rec.record(
            name,
            i,
            stall_s=block + log.extra_s,
            block_s=block,
            extra_step_s=log.extra_s,
            steps_during=len(log.during),
            baseline_step_s=log.baseline_s,
            durable_s=durable,
            bytes=total,
        )
        _remove(ctx, folder / f"rep{i}")


def dcp_async(ctx: Ctx) -> None:
    """dcp.async_save in its default thread mode, with training steps while it writes."""
    _async_row(ctx, "dcp_async", AsyncCheckpointerType.THREAD)


def dcp_async_process(ctx: Ctx) -> None:
    """dcp.async_save with a checkpoint daemon process (seen to hang: the parent times it)."""
    _async_row(ctx, "dcp_async_process", AsyncCheckpointerType.PROCESS)


ROWS: dict[str, RowFn] = {
    "raw_write": raw_write,
    "memcpy": memcpy,
    "torch_save": torch_save,
    "dcp_save": dcp_save,
    "dcp_async": dcp_async,
    "dcp_async_process": dcp_async_process,
}
