"""A checkpoint directory written by `torch.distributed.checkpoint` (DCP): where it is (torchtitan's `step-N` folders
included), what its `.metadata` says, checked, and whether its data files hold what it says, all read as hostile
input without unpickling anything but DCP's own classes (ftsup/store/DESIGN.md, DCP checkpoints). Stdlib only.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftsup.store import dcppickle, dtypes, safefile
from ftsup.store.dcppickle import DType, Layout, MemoryFormat, Record, Size
from ftsup.store.errors import CheckpointError, ModelFileError

METADATA_NAME = ".metadata"
METADATA_MAX_BYTES = 1 << 30
MAX_DIMS = 64
MAX_LOOSE_CHUNKS = 1024  # chunks of one tensor checked pairwise for overlaps
_STEP_DIR = re.compile(r"^step-(\d{1,18})$")  # torchtitan's `step-N`, and ftsup's own zero-padded names


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: its box, and the bytes of the data file that hold it (a torch.save archive)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    """The checkpoint's dtype name (`ftsup.store.dtypes`): torch's, without `torch.`."""
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        n = dtypes.lookup(self.dtype, self.name).itemsize
        for d in self.size:
            n *= d
        return n


@dataclass(frozen=True)
class Blob:
    """A value DCP saved as bytes (anything but a tensor: a pickle; never read here)."""

    name: str
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpCheckpoint:
    path: Path
    tensors: dict[str, Tensor]
    blobs: dict[str, Blob]
    version: str | None
    files: dict[str, int]
    """Each data file the metadata names, and its size (checked: every range it names lies inside)."""


def is_dcp_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds a DCP checkpoint (`.metadata`) or torchtitan's `step-N/.metadata` folders."""
    root = Path(path)
    return (root / METADATA_NAME).exists() or bool(steps(root))


def steps(root: Path) -> dict[int, Path]:
    """torchtitan's layout: each `step-N` folder of `root` that holds a `.metadata`, by N."""
    found: dict[int, Path] = {}
    try:
        entries = list(os.scandir(root))
    except OSError:
        return found
    for e in entries:
        m = _STEP_DIR.match(e.name)
        if m and e.is_dir(follow_symlinks=False) and os.path.lexists(os.path.join(e.path, METADATA_NAME)):
            found[int(m.group(1))] = Path(e.path)
    return found


def locate(path: str | os.PathLike[str], step: int | None = None) -> Path:
    """The DCP checkpoint directory `path` names: itself when it holds `.metadata` (no `step` then), else its
    `step-N` folder of `step`, or the newest one. ModelFileError naming what is there instead."""
    root = Path(path)
    if step is None and os.path.lexists(root / METADATA_NAME):
        return root
    found = steps(root)
    if step is not None:
        if step not in found:
            have = ", ".join(str(s) for s in sorted(found)[-5:]) or "none"
            raise ModelFileError(
                f"{root}: no DCP checkpoint of step {step} (step-{step}/{METADATA_NAME}; steps: {have})"
            )
        return found[step]
    if not found:
        raise ModelFileError(f"{root}: not a DCP checkpoint (no {METADATA_NAME}, nor step-N/{METADATA_NAME} folders)")
    return found[max(found)]


def read(path: Path) -> DcpCheckpoint:
    """The checked metadata of the DCP checkpoint in `path` (`locate` it first), its data files looked at (regular
    files holding every range named): ModelFileError naming the file and what is wrong. No tensor byte is read."""
    what = f"{path / METADATA_NAME}"
    raw = safefile.read_regular(path / METADATA_NAME, what, METADATA_MAX_BYTES, error=ModelFileError)
    try:
        obj = dcppickle.load_metadata(raw, what)
        ckpt = _check(path, obj, what)
    except ModelFileError:
        raise
    except CheckpointError as e:
        message = str(e)
        raise ModelFileError(message if message.startswith(what) else f"{what}: {message}") from None
    _check_files(ckpt, what)
    return ckpt


def _check(path: Path, obj: Any, what: str) -> DcpCheckpoint:
    top = _rec(obj, "Metadata", "the top level")
    sd_meta = _field(top, "state_dict_metadata", dict)
    storage = _field(top, "storage_data", dict)
    version = top.get("version")
    if version is not None and not isinstance(version, str):
        raise CheckpointError("version is not a string")
    where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for key, info in storage.items():
        index = _rec(key, "MetadataIndex", "a key of storage_data")
        fqn = index.get("fqn")
        if not isinstance(fqn, str):
            raise CheckpointError("a storage_data key without a name")
        offset = index.get("offset")
        box = None if offset is None else _dims(offset, f"storage_data[{fqn!r:.80}].offset")
        s = _rec(info, "_StorageInfo", f"storage_data[{fqn!r:.80}]")
        rel, at, n = s.get("relative_path"), s.get("offset"), s.get("length")
        if not isinstance(rel, str) or type(at) is not int or type(n) is not int or at < 0 or n < 0:
            raise CheckpointError(f"storage_data[{fqn!r:.80}]: not a file, offset and length")
        if s.get("transform_descriptors"):
            raise CheckpointError(f"{fqn!r:.80} is stored transformed (compressed?), which is not read here")
        try:
            safefile.validate_relpath(rel)
        except CheckpointError:
            raise CheckpointError(f"storage_data[{fqn!r:.80}] names file {rel!r:.120}, outside the directory") from None
        where[(fqn, box)] = (rel, at, n)
    tensors: dict[str, Tensor] = {}
    blobs: dict[str, Blob] = {}
    budget = len(storage)  # each chunk has its own entry: a list shared many times over is refused, not walked
    for fqn, entry in sd_meta.items():
        if not isinstance(fqn, str):
            raise CheckpointError("a state_dict_metadata key that is not a string")
        label = f"{fqn!r:.80}"
        if isinstance(entry, Record) and entry.kind == "BytesStorageMetadata":
            if (fqn, None) not in where:
                raise CheckpointError(f"{label}: no storage_data entry for its bytes")
            blobs[fqn] = Blob(fqn, *where[(fqn, None)])
            continue
        t = _rec(entry, "TensorStorageMetadata", label)
        dtype = _dtype(_field(t, "properties", Record), label)
        size = _dims(t.get("size"), f"{label}.size")
        raw_chunks = _field(t, "chunks", list)
        budget -= len(raw_chunks)
        if budget < 0:
            raise CheckpointError("more chunks than storage_data entries")
        chunks = []
        for c in raw_chunks:
            cr = _rec(c, "ChunkStorageMetadata", f"a chunk of {label}")
            offsets = _dims(cr.get("offsets"), f"a chunk of {label}")
            sizes = _dims(cr.get("sizes"), f"a chunk of {label}")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise CheckpointError(f"a chunk of {label} has {len(offsets)} dimensions, the tensor {len(size)}")
            if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
                raise CheckpointError(
                    f"a chunk of {label} at {list(offsets)} of {list(sizes)} lies outside {list(size)}"
                )
            if (fqn, offsets) not in where:
                raise CheckpointError(f"a chunk of {label} at {list(offsets)} has no storage_data entry")
            chunks.append(Chunk(offsets, sizes, *where[(fqn, offsets)]))
        _tiles(label, size, chunks)
        tensors[fqn] = Tensor(fqn, dtype, size, tuple(chunks))
    files = {f: 0 for f, _, _ in where.values()}
    return DcpCheckpoint(path, tensors, blobs, version, files)


def _tiles(label: str, size: tuple[int, ...], chunks: list[Chunk]) -> None:
    """The chunks cover the tensor, each element once: their volumes add up to its own and no two overlap (a sort
    where each holds whole rows of dim 0, as FSDP2's do; else pairs, of at most MAX_LOOSE_CHUNKS chunks)."""
    total = math.prod(size)
    if sum(math.prod(c.sizes) for c in chunks) != total:
        raise CheckpointError(f"{label}: its chunks do not add up to its size {list(size)} (a hole, or an overlap)")
    full = [c for c in chunks if math.prod(c.sizes)]
    if len(full) < 2:
        return
    if all(c.offsets[1:] == (0,) * (len(size) - 1) and c.sizes[1:] == size[1:] for c in full):
        rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in full)
        if any(a[1] > b[0] for a, b in itertools.pairwise(rows)):
            raise CheckpointError(f"{label}: two of its chunks overlap")
        return
    if len(full) > MAX_LOOSE_CHUNKS:
        raise CheckpointError(f"{label}: {len(full)} chunks that are not whole rows (at most {MAX_LOOSE_CHUNKS})")
    for i, a in enumerate(full):
        for b in full[i + 1 :]:
            if all(
                max(ao, bo) < min(ao + an, bo + bn)
                for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                raise CheckpointError(f"{label}: its chunks at {list(a.offsets)} and {list(b.offsets)} overlap")


def _check_files(ckpt: DcpCheckpoint, what: str) -> None:
    """Each data file a regular file holding every range the metadata names (sizes by `fstat`, nothing read)."""
    ends: dict[str, tuple[int, str]] = {}
    items: list[tuple[str, str, int, int]] = [
        (c.file, t.name, c.offset, c.length) for t in ckpt.tensors.values() for c in t.chunks
    ]
    items += [(b.file, b.name, b.offset, b.length) for b in ckpt.blobs.values()]
    for file, name, offset, length in items:
        if file not in ends or offset + length > ends[file][0]:
            ends[file] = (offset + length, name)
    for file, (end, name) in sorted(ends.items()):
        path = ckpt.path / file
        fd = safefile.open_regular(path, f"{path} (named by {what})", ModelFileError)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if end > size:
            raise ModelFileError(f"{path}: {size} bytes, but {what} puts {name!r:.80} up to byte {end}: cut short?")
        ckpt.files[file] = size


def _rec(obj: Any, kind: str, where: str) -> dict[str, Any]:
    """The state of a stand-in of `kind` (a dict, or TensorProperties' tuple), checked."""
    if not isinstance(obj, Record) or obj.kind != kind:
        raise CheckpointError(f"{where} is not a {kind}")
    state = obj.state
    if kind == "TensorProperties" and isinstance(state, tuple):
        return {"dtype": state[0] if state else None, "layout": state[1] if len(state) > 1 else None}
    if state is None:
        return {}
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
        merged = dict(state[0] or {})
        merged.update(state[1])
        state = merged
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: a {kind} with a state that is not a mapping")
    return state


def _field(rec: dict[str, Any], name: str, kind: type) -> Any:
    value = rec.get(name)
    if not isinstance(value, kind):
        raise CheckpointError(f"{name} is not a {kind.__name__}")
    return value


def _dims(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, Size | tuple | list) or len(value) > MAX_DIMS:
        raise CheckpointError(f"{where}: not a size of at most {MAX_DIMS} dimensions")
    if not all(type(d) is int and 0 <= d < 1 << 62 for d in value):
        raise CheckpointError(f"{where}: a size that is not made of integers >= 0")
    return tuple(value)


def _dtype(props: Any, where: str) -> str:
    p = _rec(props, "TensorProperties", f"{where}.properties")
    dtype, layout = p.get("dtype"), p.get("layout")
    if not isinstance(dtype, DType):
        raise CheckpointError(f"{where}: no dtype")
    if layout is not None and not isinstance(layout, Layout):
        raise CheckpointError(f"{where}: layout is not torch.strided")
    for v in p.values():
        if not isinstance(v, DType | Layout | MemoryFormat | bool | type(None)):
            raise CheckpointError(f"{where}: properties hold a {type(v).__name__}")
    dtypes.lookup(dtype.name, where)
    return dtype.name
