"""`HubReader`: the tensors of a Hugging Face Hub-layout model, whole or rows of dim 0, read by byte ranges over a
few reading threads, verified where the caller has block checksums (trainer/checkpoint/DESIGN.md, Import).

Not here: the headers and the index (`ftsup.store.hublayout`), writing (`write`).
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy
import torch

from ftsup.store import dtypes, hublayout, safefile, stheader
from ftsup.store.errors import ModelFileError
from ftsup.trainer.checkpoint import codec
from ftsup.trainer.checkpoint.shardio import PAGE, VerifiedFile, aligned_buffer, as_memoryview, open_direct, round_up

PIECE_BYTES = 8 << 20
READ_THREADS = 4  # 4 reads of 8 MiB in flight, not 8 of 4 MiB: trainer/checkpoint/DESIGN.md


class _Shared:
    """The process's reading threads, each with its page-aligned buffer, made on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.scratch = threading.local()  # each reading thread's buffer

    def get_pool(self) -> ThreadPoolExecutor:
        with self.lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ftsup-hub-read")
            return self.pool

    def forget(self) -> None:
        """In a forked child: the parent's threads are not there; new ones are made on the next read."""
        self.lock = threading.Lock()
        self.pool = None
        self.scratch = threading.local()


_shared = _Shared()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_shared.forget)


def release_reading_threads() -> None:
    """Stop the process's reading threads (waiting for them) and let their buffers go; the next read makes new
    ones. For a process that reads no more models and wants the memory back; not while a read is in flight. (At
    exit, concurrent.futures joins the idle threads itself.)"""
    with _shared.lock:
        pool, _shared.pool = _shared.pool, None
        _shared.scratch = threading.local()
    if pool is not None:
        pool.shutdown(wait=True)


class HubReader(safefile.OpenFiles):
    """Ranged reads of a Hub-layout model's tensors; a context manager (it keeps files open)."""

    def __init__(self, model: hublayout.HubModel, verified: Mapping[str, VerifiedFile] | None = None):
        super().__init__()
        self.model = model
        self.verified = dict(verified or {})
        self.bytes_read = 0
        self._tensors = model.tensors
        self._direct: dict[str, int | None] = {}  # O_DIRECT descriptors (None: refused)

    def close(self) -> None:
        super().close()
        direct, self._direct = self._direct, {}
        for fd in [d for d in direct.values() if d is not None]:
            os.close(fd)

    def entry(self, name: str) -> stheader.TensorEntry:
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.model.root}: the model has no tensor {name!r:.200}") from None

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The torch dtype and shape of tensor `name`."""
        e = self.entry(name)
        d = dtypes.BY_SAFETENSORS.get(e.dtype)
        where = f"{self.model.root / self.model.weight_map[name]}: tensor {name!r:.200}"
        if d is None:
            raise ModelFileError(f"{where} has dtype {e.dtype}, which torch has no dtype for; it cannot be loaded")
        shape = list(e.shape)
        if d.packed > 1:  # safetensors counts packed values, torch their bytes (codec.DType.packed)
            if not shape or shape[-1] % d.packed:
                raise ModelFileError(f"{where}: a {e.dtype} shape {shape} does not pack into whole bytes")
            shape[-1] //= d.packed
        return codec.dtype_from_name(d.name), tuple(shape)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name`, whole (read into `out` where given: as in `read_rows`)."""
        dtype, shape = self.spec(name)
        if not shape:
            e = self.entry(name)
            return _aligned(self._read(name, e.start, e.nbytes, out), dtype).view(dtype).reshape(())
        return self.read_rows(name, 0, shape[0], out)

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of the first dimension of tensor `name` (its only bytes read). `out`: a contiguous
        uint8 CPU tensor of exactly those bytes to read them into (memory the caller reuses, its pages faulted in
        already), or None for a new buffer; a file with block checksums is read into buffers of its own."""
        dtype, shape = self.spec(name)
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise ModelFileError(
                f"{self.model.root}: rows {start}..{stop} of tensor {name!r:.200} of shape {list(shape)}"
            )
        e = self.entry(name)
        row = e.nbytes // shape[0] if shape[0] else 0
        raw = self._read(name, e.start + start * row, (stop - start) * row, out)
        return _aligned(raw, dtype).view(dtype).reshape((stop - start, *shape[1:]))

    def read_rows_into(self, parts: Sequence[tuple[str, int, int, torch.Tensor]]) -> None:
        """`read_rows(name, start, stop, out)` for each of `parts`, all at once: the pieces of every part are spread
        over the reading threads together (one tensor's rows after another's, each part a piece or two, left one
        read in flight and the disk idle between them). A file with block checksums is read part after part."""
        jobs: list[Callable[[], None]] = []
        for name, start, stop, out in parts:
            dtype, shape = self.spec(name)
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise ModelFileError(
                    f"{self.model.root}: rows {start}..{stop} of tensor {name!r:.200} of shape {list(shape)}"
                )
            if self.model.weight_map[name] in self.verified:
                self.read_rows(name, start, stop, out)
                continue
            e = self.entry(name)
            row = e.nbytes // shape[0] if shape[0] else 0
            jobs += self._pieces(name, e.start + start * row, (stop - start) * row, out)
        self._run(jobs)

    def _read(self, name: str, start: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None and (out.numel() != n or out.dtype != torch.uint8 or not out.is_contiguous()):
            raise ValueError(f"out: {n} contiguous bytes to read {name!r:.200} into, not {out.numel()} {out.dtype}")
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        file = self.model.weight_map[name]
        vf = self.verified.get(file)
        if vf is not None:
            self.bytes_read += n
            ((base, region),) = vf.read_ranges([(start, start + n)])
            return region[start - base : start - base + n]
        target = out if out is not None else torch.frombuffer(bytearray(n), dtype=torch.uint8)
        self._run(self._pieces(name, start, n, target, direct=out is not None))
        return target

    def _pieces(
        self, name: str, start: int, n: int, out: torch.Tensor, direct: bool = True
    ) -> list[Callable[[], None]]:
        """The reads that fill `out` (n contiguous uint8 bytes) with the file's bytes from `start`: one per piece."""
        if out.numel() != n or out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError(f"out: {n} contiguous bytes to read {name!r:.200} into, not {out.numel()} {out.dtype}")
        if n == 0:
            return []
        file = self.model.weight_map[name]
        self.bytes_read += n
        fd = self._open(file)
        view = as_memoryview(out)
        dfd = self._open_direct(file, fd) if direct else None

        def fill(lo: int) -> None:
            pos, hi = lo, min(n, lo + PIECE_BYTES)
            if dfd is not None and self._read_direct(
                dfd, start + lo, view[lo:hi], f"{file}: ends inside tensor {name!r:.200}"
            ):
                return
            while pos < hi:
                got = os.preadv(fd, [view[pos:hi]], start + pos)
                if got <= 0:
                    raise ModelFileError(f"{self.model.root / file}: ends inside tensor {name!r:.200}")
                pos += got

        return [functools.partial(fill, lo) for lo in range(0, n, PIECE_BYTES)]

    def _run(self, jobs: list[Callable[[], None]]) -> None:
        """Run `jobs` (one inline; more on the reading threads), re-raising the first failure once all are done."""
        if len(jobs) == 1:
            jobs[0]()
            return
        if not jobs:
            return
        pool = _shared.get_pool()
        futures = [pool.submit(job) for job in jobs]
        errors = [f.exception() for f in futures]  # waits for every one: none still writes into `out` afterwards
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _read_direct(self, fd: int, start: int, into: memoryview, short: str) -> bool:
        """Fill `into` with the file's bytes from `start` by O_DIRECT reads of whole pages; False where the
        filesystem refuses them (the caller then reads through the page cache). `short`: the error where the file
        ends first (the file and the tensor)."""
        lo, hi = start // PAGE * PAGE, round_up(start + len(into), PAGE)
        scratch = _shared.scratch
        buf = getattr(scratch, "buf", None)
        if buf is None or buf.numel() < hi - lo:
            buf = scratch.buf = aligned_buffer(max(hi - lo, PIECE_BYTES + 2 * PAGE))
        mv, pos, want = as_memoryview(buf)[: hi - lo], 0, start + len(into) - lo
        while pos < want:
            try:
                got = os.preadv(fd, [mv[pos:]], lo + pos)
            except OSError as e:
                if e.errno == errno.EINVAL:
                    return False
                raise
            if got <= 0:
                raise ModelFileError(f"{self.model.root / short} (at byte {lo + pos})")
            pos += got
        # numpy's copy releases the GIL (a memoryview's holds it): the reading threads copy side by side
        numpy.copyto(numpy.asarray(into), numpy.asarray(mv[start - lo : start - lo + len(into)]))
        return True

    def _open_direct(self, file: str, fd: int) -> int | None:
        if file not in self._direct:
            direct = open_direct(str(self.model.path(file)), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            if direct is not None and not os.path.samestat(os.fstat(direct), os.fstat(fd)):
                os.close(direct)  # replaced since it was opened: read it all through `fd`
                direct = None
            self._direct[file] = direct
        return self._direct[file]

    def _open(self, file: str) -> int:
        what, size = str(self.model.root / file), self.model.headers[file].file_size
        return self.opened(file, self.model.path(file), what, size, "its header was read", ModelFileError)


def _aligned(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`raw` (bytes), copied where it does not start on an element boundary of `dtype`: a file of another
    writer may place a tensor at any offset, and a view as `dtype` needs its elements aligned."""
    return raw.clone() if raw.storage_offset() % dtype.itemsize else raw
