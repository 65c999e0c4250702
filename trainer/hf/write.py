"""Writing a model in the Hugging Face Hub's layout, one tensor in memory at a time, through page-aligned staging
buffers written with O_DIRECT (trainer/checkpoint/DESIGN.md, Export).

Not here: where the tensors come from, the output directory and its rename (`export`).
"""

from __future__ import annotations

import errno
import math
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

from ftsup.store import hublayout, stheader
from ftsup.store.errors import CheckpointError
from ftsup.trainer.checkpoint import codec
from ftsup.trainer.checkpoint.shardio import PAGE, aligned_buffer, as_memoryview, open_direct

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_WRITE_BLOCK = 64 << 20
STAGE_BYTES = 4 << 20  # a multiple of PAGE: every buffer but a file's last is written whole with O_DIRECT
STAGE_BUFFERS = 4  # one being filled, the others being written or waiting to be
FILE_METADATA = {"format": "pt"}  # what save_torch_state_dict (and save_pretrained) put in every file

Read = Callable[[], torch.Tensor | Sequence[torch.Tensor]]


@dataclass(frozen=True)
class OutTensor:
    """One tensor to write: its name in the model, the dtype and (torch) shape it is written in, and how
    to read it (on the CPU, in its stored dtype; converted here when that is not `dtype`): the tensor
    whole, or pieces whose elements, one after the other, are the tensor's (the rows of dim 0 that each
    saved chunk holds, without assembling them). What a read returns is used before the next read."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Read

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    def header(self) -> tuple[str, list[int]]:
        """Its safetensors dtype and shape; CheckpointError naming it where safetensors has none."""
        entry = codec.safetensors_header(self.dtype, list(self.shape), self.name)
        if entry is None:
            dims = "" if self.shape else " (0-dimensional)"
            raise CheckpointError(
                f"tensor {self.name!r} has dtype {codec.dtype_name(self.dtype)}{dims}, which safetensors cannot "
                "store; convert it (or leave it out with --prefix) before exporting"
            )
        return entry


def check(tensors: Sequence[OutTensor]) -> None:
    """Refuse, before anything is written, what cannot be written: a dtype safetensors lacks, a name twice."""
    seen: set[str] = set()
    for t in tensors:
        t.header()
        if t.name in seen:
            raise CheckpointError(f"two tensors are named {t.name!r}")
        seen.add(t.name)


def plan(tensors: Sequence[OutTensor], max_shard_bytes: int) -> list[tuple[str, list[OutTensor]]]:
    """The files `write_model` writes, each with its tensors in the order their bytes follow (the order they are
    read in: a source can read ahead in it)."""
    shards = hublayout.plan_shards([(t.name, t.nbytes) for t in tensors], max_shard_bytes)
    by_name = {t.name: t for t in tensors}
    out = []
    for fname, names in zip(hublayout.shard_names(len(shards)), shards, strict=True):
        group = [by_name[n] for n in names]
        order = stheader.write_order([(t.name, t.header()[0]) for t in group])
        out.append((fname, [group[i] for i in order]))
    return out


def write_model(
    out: Path, tensors: Sequence[OutTensor], max_shard_bytes: int, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Write `tensors` into the directory `out` (which this process created); returns the index
    (`{"metadata": {"total_size"}, "weight_map"}`, also for one file, where none is written).
    `progress(n)`: called with each tensor's bytes once they are staged for writing."""
    check(tensors)
    files = plan(tensors, max_shard_bytes)
    # The staging buffers: together about a shard where shards are small, never more than STAGE_BUFFERS of
    # STAGE_BYTES.
    stage = min(STAGE_BYTES, max(PAGE, -(-max_shard_bytes // STAGE_BUFFERS // PAGE) * PAGE))
    buffers = [aligned_buffer(stage) for _ in range(STAGE_BUFFERS)]
    weight_map: dict[str, str] = {}
    for fname, group in files:
        _write_file(out / fname, group, buffers, progress)
        weight_map.update(dict.fromkeys((t.name for t in group), fname))
    weight_map = {t.name: weight_map[t.name] for t in tensors}  # the index lists them in the model's order
    total = sum(t.nbytes for t in tensors)
    if len(files) > 1:
        write_new(out / hublayout.INDEX_NAME, hublayout.index_bytes(weight_map, total))
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def write_new(path: Path, data: bytes | memoryview) -> None:
    """Create `path` (never one that exists, never through a link), write `data`, fsync."""
    fd = os.open(path, _CREATE, 0o644)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(
    path: Path, group: Sequence[OutTensor], buffers: list[torch.Tensor], progress: Callable[[int], None] | None
) -> None:
    """One file: `group` in the order their bytes follow."""
    head = stheader.encode([(t.name, *t.header(), t.nbytes) for t in group], FILE_METADATA)
    with _Sink(path, buffers) as sink:
        sink.put(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        for t in group:
            got = t.read()
            pieces = [got] if isinstance(got, torch.Tensor) else list(got)
            if len(pieces) == 1 and tuple(pieces[0].shape) != t.shape:
                raise CheckpointError(
                    f"tensor {t.name!r} was read with shape {list(pieces[0].shape)}, not {list(t.shape)}"
                )
            if sum(p.numel() for p in pieces) != math.prod(t.shape):
                raise CheckpointError(
                    f"tensor {t.name!r} was read with {sum(p.numel() for p in pieces)} elements, "
                    f"not {math.prod(t.shape)}"
                )
            while pieces:  # each let go once staged
                piece = pieces.pop(0)
                if piece.dtype != t.dtype:
                    piece = piece.to(t.dtype)
                if piece.numel():
                    sink.put(piece.contiguous().reshape(-1).view(torch.uint8))
                del piece
            del got
            if progress is not None:
                progress(t.nbytes)


class _Sink:
    """One new file, written sequentially: `put` copies bytes into the current staging buffer, and a full
    buffer goes to the writing thread (O_DIRECT where the filesystem allows it) while the next one fills.
    Leaving the context writes the rest, waits for the thread and fsyncs (or, on an error, only waits)."""

    def __init__(self, path: Path, buffers: list[torch.Tensor]):
        self.path = path
        self.fd = os.open(path, _CREATE, 0o644)
        try:
            direct = open_direct(str(path), os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        except BaseException:
            os.close(self.fd)
            raise
        if direct is not None and not os.path.samestat(os.fstat(direct), os.fstat(self.fd)):
            os.close(direct)  # another file by that name since: write only through `fd`
            direct = None
        self.direct = direct
        self.free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for b in buffers:
            self.free.put(b)
        self.full: queue.SimpleQueue[tuple[torch.Tensor, int, int] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.abandoned = False  # leaving on an error: what is still queued is not written
        self.cur: torch.Tensor | None = None
        self.fill = 0  # bytes in `cur`
        self.offset = 0  # where `cur` starts in the file
        self.thread = threading.Thread(target=self._run, name="ftsup-hf-write", daemon=True)
        self.thread.start()

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, et: Any, e: Any, tb: Any) -> None:
        try:
            if et is None and self.cur is not None and self.fill:
                self.full.put((self.cur, self.offset, self.fill))
                self.cur = None
            self.abandoned = et is not None
            self.full.put(None)
            self.thread.join()
            if et is None:
                if self.error is not None:
                    raise self.error
                os.fsync(self.fd)
        finally:
            if self.cur is not None:
                self.free.put(self.cur)
            if self.direct is not None:
                os.close(self.direct)
            os.close(self.fd)

    def put(self, data: torch.Tensor) -> None:
        """Stage the bytes of `data` (a contiguous 1-D uint8 tensor); returns once they are copied."""
        pos, n = 0, data.numel()
        while pos < n:
            if self.cur is None:
                self.cur = self.free.get()
                if self.error is not None:
                    raise self.error
            k = min(n - pos, self.cur.numel() - self.fill)
            # numpy's copy: one thread, the GIL released (torch's splits it over its intra-op threads, which on a
            # busy machine wait for each other: trainer/checkpoint/DESIGN.md, Export)
            numpy.copyto(self.cur[self.fill : self.fill + k].numpy(), data[pos : pos + k].numpy())
            self.fill += k
            pos += k
            if self.fill == self.cur.numel():
                self.full.put((self.cur, self.offset, self.fill))
                self.cur, self.offset, self.fill = None, self.offset + self.fill, 0

    def _run(self) -> None:
        while (item := self.full.get()) is not None:
            buf, offset, n = item
            try:
                if self.error is None and not self.abandoned:
                    self._write(as_memoryview(buf)[:n], offset)
            except BaseException as e:  # surfaced by the next put or by leaving the context
                self.error = e
            finally:
                self.free.put(buf)

    def _write(self, mv: memoryview, offset: int) -> None:
        bulk = len(mv) // PAGE * PAGE if self.direct is not None else 0
        try:
            _pwrite_all(self.direct, mv[:bulk], offset) if bulk else None
        except OSError as e:
            if not _refused(e):
                raise
            os.close(self.direct)  # type: ignore[arg-type]
            self.direct, bulk = None, 0
        _pwrite_all(self.fd, mv[bulk:], offset + bulk)


def _refused(e: OSError) -> bool:
    return e.errno == errno.EINVAL


def _pwrite_all(fd: int | None, mv: memoryview, offset: int) -> None:
    assert fd is not None
    pos = 0
    while pos < len(mv):
        n = os.pwrite(fd, mv[pos : pos + _WRITE_BLOCK], offset + pos)
        if n <= 0:
            raise OSError("short write")
        pos += n


def _write_all(fd: int, mv: memoryview) -> None:
    pos = 0
    while pos < len(mv):
        n = os.write(fd, mv[pos : pos + _WRITE_BLOCK])
        if n <= 0:
            raise OSError("short write")
        pos += n
