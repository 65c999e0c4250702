"""`BoxReader`: any box of a DCP checkpoint's tensor, read by byte ranges of the chunks it overlaps (whole rows of
each chunk's overlap), never a byte of another rank's share (trainer/checkpoint/DESIGN.md, DCP interop).

Not here: the metadata and the archives' structure (`ftsup.store.dcpdir`, `ftsup.store.dcparchive`).
"""

from __future__ import annotations

import math
import os

import torch

from ftsup.store import dcparchive, dcpdir, safefile
from ftsup.store.errors import ModelFileError
from ftsup.trainer.checkpoint import codec
from ftsup.trainer.checkpoint.shardio import as_memoryview


class BoxReader(safefile.OpenFiles):
    """Ranged reads of a DCP checkpoint's tensors; a context manager (it keeps its data files open).
    `bytes_read`: tensor bytes read; `structure_bytes_read`: bytes of the archives' own records read to find them."""

    def __init__(self, ckpt: dcpdir.DcpCheckpoint) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.bytes_read = 0
        self.structure_bytes_read = 0
        self._where: dict[tuple[str, str, int], dcparchive.ChunkBytes] = {}

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box at `offsets` of `sizes` of tensor `name`, in its own memory (the checkpoint's dtype)."""
        t = self.ckpt.tensors[name]
        dtype = codec.dtype_from_name(t.dtype, name)
        if len(offsets) != len(t.size) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, t.size, strict=True)
        ):
            raise ValueError(f"box {list(offsets)} of {list(sizes)} is not inside {name!r} of {list(t.size)}")
        out = torch.empty(sizes, dtype=dtype)
        if out.numel() == 0:
            return out
        for c in t.chunks:
            lo = tuple(max(o, co) for o, co in zip(offsets, c.offsets, strict=True))
            hi = tuple(min(o + n, co + cn) for o, n, co, cn in zip(offsets, sizes, c.offsets, c.sizes, strict=True))
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            r0, r1 = (lo[0] - c.offsets[0], hi[0] - c.offsets[0]) if lo else (0, 0)
            into = None
            if lo and lo[1:] == offsets[1:] == c.offsets[1:] and sizes[1:] == c.sizes[1:]:
                # Whole rows of both: read straight into the box's rows (contiguous), no buffer and no copy.
                into = out.narrow(0, lo[0] - offsets[0], r1 - r0).reshape(-1).view(torch.uint8)
            part = self._chunk_rows(t, c, dtype, r0, r1, into)
            if part is None:
                continue
            src, dst = part, out
            for dim in range(len(lo)):
                first = lo[dim] - c.offsets[dim] if dim else 0  # `part` starts at the overlap's first row
                src = src.narrow(dim, first, hi[dim] - lo[dim])
                dst = dst.narrow(dim, lo[dim] - offsets[dim], hi[dim] - lo[dim])
            dst.copy_(src)
        return out

    def _chunk_rows(
        self, t: dcpdir.Tensor, c: dcpdir.Chunk, dtype: torch.dtype, r0: int, r1: int, into: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Rows [r0, r1) of dim 0 of chunk `c` (its whole value for a 0-dimensional tensor); None where they were read
        into `into` (their bytes' memory), which a contiguous chunk's rows are."""
        fd = self._open(c.file)
        key = (t.name, c.file, c.offset)
        where = self._where.get(key)
        what = f"{self.ckpt.path / c.file} (tensor {t.name!r:.200} at {list(c.offsets)})"
        if where is None:
            where, n = dcparchive.locate(fd, c.offset, c.length, what)
            self.structure_bytes_read += n
            if where.dtype != t.dtype or where.size != c.sizes:
                raise ModelFileError(
                    f"{what}: holds a {where.dtype} tensor of {list(where.size)}; "
                    f"its metadata says {t.dtype} of {list(c.sizes)}"
                )
            self._where[key] = where
        item = dtype.itemsize
        if not c.sizes:
            return self._pread(fd, where.start + where.storage_offset * item, item, what).view(dtype).reshape(())
        if not where.contiguous:  # another writer's strided view: its whole storage, then the view
            storage = self._pread(fd, where.start, where.nbytes, what).view(dtype)
            return storage.as_strided(where.size, where.stride, where.storage_offset).narrow(0, r0, r1 - r0)
        row = math.prod(c.sizes[1:])
        start, n = where.start + (where.storage_offset + r0 * row) * item, (r1 - r0) * row * item
        if into is not None:
            self._pread(fd, start, n, what, into)
            return None
        return self._pread(fd, start, n, what).view(dtype).reshape((r1 - r0, *c.sizes[1:]))

    def _pread(self, fd: int, start: int, n: int, what: str, into: torch.Tensor | None = None) -> torch.Tensor:
        buf = torch.empty(n, dtype=torch.uint8) if into is None else into
        view = as_memoryview(buf)
        pos = 0
        while pos < n:
            got = os.preadv(fd, [view[pos:]], start + pos)
            if got <= 0:
                raise ModelFileError(f"{what}: the file ends at byte {start + pos}, inside the tensor's bytes")
            pos += got
        self.bytes_read += n
        return buf

    def _open(self, file: str) -> int:
        path = self.ckpt.path / file
        since = "the checkpoint's metadata was read"
        return self.opened(file, path, str(path), self.ckpt.files[file], since, ModelFileError)
