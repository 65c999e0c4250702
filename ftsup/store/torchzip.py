"""A file written by `torch.save` read as hostile input without torch and without running its pickle: whether the
archive is whole, its object tree with each tensor as a reference (`TensorRef`: where its bytes are), and ranged reads
of those bytes. Globals the pickle names are never imported: each becomes an inert `Stub` (docs/deepspeed.md).
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from ftsup.store import safefile
from ftsup.store.dcparchive import Window
from ftsup.store.errors import CheckpointCorruptError

MAX_PICKLE_BYTES = 64 << 20  # the object tree without tensor data: a model's names and shapes, a config
MAX_MEMBERS = 1_000_000
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")

# torch's storage classes, as a pickle names them -> the element's dtype name and size
STORAGE_DTYPES = {
    "DoubleStorage": ("float64", 8),
    "FloatStorage": ("float32", 4),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
}


@dataclass(frozen=True)
class Storage:
    key: str
    dtype: str
    itemsize: int
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the archive: its storage, and the elements of it that are the tensor (contiguous ones only)."""

    storage: Storage
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        expected, n = [], 1
        for size in reversed(self.shape):
            expected.append(n)
            n *= size
        return all(s == e or size == 1 for s, e, size in zip(self.stride, reversed(expected), self.shape, strict=True))


class Stub:
    """Whatever a pickle builds from a global that is not a tensor or a plain container: it keeps the arguments and
    the state it was given, and runs nothing."""

    qualname = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Stub:
        self = super().__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    args: tuple[Any, ...]
    state: Any

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("torch", "Size"): lambda *a: tuple(*a),
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storages: dict[str, Storage], what: str) -> None:
        super().__init__(io.BytesIO(data))
        self._storages, self._what = storages, what
        self._stubs: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _tensor
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return lambda data, *_: data
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _from_type
        if module == "torch" and name in STORAGE_DTYPES:
            return ("storage-type", name)
        if module == "torch" and name in {d for d, _ in STORAGE_DTYPES.values()}:
            return name
        stub = self._stubs.get((module, name))
        if stub is None:
            stub = self._stubs[(module, name)] = type(name, (Stub,), {"qualname": f"{module}.{name}"})
        return stub

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointCorruptError(f"{self._what}: a persistent id that is not a storage ({pid!r:.80})")
        _, kind, key, _location, numel = pid
        dtype = kind[1] if isinstance(kind, tuple) and kind[:1] == ("storage-type",) else kind
        if dtype in STORAGE_DTYPES:
            dtype = STORAGE_DTYPES[dtype][0]
        sizes = {d: s for d, s in STORAGE_DTYPES.values()}
        if not isinstance(key, str) or dtype not in sizes or not isinstance(numel, int) or numel < 0:
            raise CheckpointCorruptError(f"{self._what}: storage {key!r:.40} of an unknown kind {dtype!r:.40}")
        got = self._storages.setdefault(key, Storage(key, dtype, sizes[dtype], numel))
        if got.dtype != dtype or got.numel != numel:
            raise CheckpointCorruptError(f"{self._what}: storage {key!r:.40} is named twice, differently")
        return got


def _tensor(storage: Any, offset: Any, shape: Any, stride: Any, *_: Any) -> TensorRef:
    if not isinstance(storage, Storage):
        raise CheckpointCorruptError(f"a tensor whose storage is {type(storage).__name__}")
    shape, stride = tuple(shape), tuple(stride)
    if not all(isinstance(x, int) and x >= 0 for x in (offset, *shape, *stride)) or len(shape) != len(stride):
        raise CheckpointCorruptError(f"a tensor of shape {shape!r:.60}, stride {stride!r:.60}, offset {offset!r:.20}")
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if math.prod(shape) else offset
    if math.prod(shape) and last >= storage.numel:
        raise CheckpointCorruptError(f"a tensor past the end of its storage {storage.key!r} ({storage.numel} elements)")
    return TensorRef(storage, offset, shape, stride)


def _from_type(func: Any, _type: Any, args: Any, _state: Any) -> Any:
    """A tensor subclass's (or one with attributes') rebuild: the tensor underneath."""
    if func is not _tensor or not isinstance(args, tuple):
        raise CheckpointCorruptError(f"a tensor rebuilt by {func!r:.60}")
    return _tensor(*args)


class Archive:
    """One `torch.save` file, opened without following a link: `tree()` its objects (tensors as `TensorRef`),
    `read(ref)` a tensor's bytes, `read_elements(ref, start, count)` a run of its elements. Raises
    CheckpointCorruptError naming the file when it is not a whole archive (a save cut short has no central
    directory; a member past the end of the file)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self._fd = safefile.open_regular(path, self.path)
        try:
            self.size = os.fstat(self._fd).st_size
            self._members = self._index()
        except BaseException:
            os.close(self._fd)
            raise
        self._storages: dict[str, Storage] = {}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _index(self) -> dict[str, tuple[int, int]]:
        """member name (without the archive's own folder) -> (offset of its data, its size); all stored."""
        try:
            with zipfile.ZipFile(Window(self._fd, 0, self.size, self.path, max_read=None)) as z:
                infos = z.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise CheckpointCorruptError(f"{self.path}: not a whole torch.save archive ({e})") from None
        if not infos or len(infos) > MAX_MEMBERS:
            raise CheckpointCorruptError(f"{self.path}: {len(infos)} members")
        prefix = infos[0].filename.split("/", 1)[0] + "/"
        members: dict[str, tuple[int, int]] = {}
        for info in infos:
            if not info.filename.startswith(prefix) or info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointCorruptError(f"{self.path}: member {info.filename!r:.80} is not a stored tensor file")
            head = safefile.pread_full(self._fd, _LOCAL_HEADER.size, info.header_offset)
            if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
                raise CheckpointCorruptError(f"{self.path}: member {info.filename!r:.80} has no local header")
            name_len, extra_len = _LOCAL_HEADER.unpack(head)[-2:]
            start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if start + info.file_size > self.size:
                raise CheckpointCorruptError(f"{self.path}: member {info.filename!r:.80} runs past the end of the file")
            members[info.filename[len(prefix) :]] = (start, info.file_size)
        if "data.pkl" not in members:
            raise CheckpointCorruptError(f"{self.path}: no data.pkl (not a torch.save archive)")
        return members

    def tree(self) -> Any:
        """The saved object, tensors as TensorRef and any other class as a Stub; every storage checked to be in the
        archive, whole."""
        start, size = self._members["data.pkl"]
        if size > MAX_PICKLE_BYTES:
            raise CheckpointCorruptError(f"{self.path}: data.pkl holds {size} bytes (at most {MAX_PICKLE_BYTES})")
        data = safefile.pread_full(self._fd, size, start)
        try:
            obj = _Unpickler(data, self._storages, self.path).load()
        except CheckpointCorruptError:
            raise
        except Exception as e:  # a hostile pickle: whatever it raises, the file is refused, naming it
            raise CheckpointCorruptError(f"{self.path}: data.pkl does not parse ({type(e).__name__}: {e})") from None
        for s in self._storages.values():
            got = self._members.get(f"data/{s.key}")
            if got is None or got[1] < s.numel * s.itemsize:
                raise CheckpointCorruptError(f"{self.path}: storage {s.key!r} is missing or short")
        return obj

    def read_elements(self, ref: TensorRef, start: int, count: int) -> bytes:
        """Elements [start, start + count) of a contiguous tensor, as bytes."""
        if not ref.contiguous or start < 0 or count < 0 or start + count > ref.numel:
            raise CheckpointCorruptError(f"{self.path}: elements {start}+{count} of a tensor of {ref.numel}")
        base, _ = self._members[f"data/{ref.storage.key}"]
        size = ref.storage.itemsize
        return safefile.pread_full(self._fd, count * size, base + (ref.offset + start) * size)

    def read_into(self, ref: TensorRef, start: int, out: memoryview) -> None:
        """Elements from `start` of a contiguous tensor into `out` (bytes, whole elements), read in place."""
        size = ref.storage.itemsize
        count = len(out) // size
        if not ref.contiguous or start < 0 or len(out) % size or start + count > ref.numel:
            raise CheckpointCorruptError(f"{self.path}: elements {start}+{count} of a tensor of {ref.numel}")
        base, _ = self._members[f"data/{ref.storage.key}"]
        at, done = base + (ref.offset + start) * size, 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done : done + (64 << 20)]], at + done)
            if n <= 0:
                raise CheckpointCorruptError(f"{self.path}: the file ended inside storage {ref.storage.key!r}")
            done += n

    def read(self, ref: TensorRef) -> bytes:
        return self.read_elements(ref, 0, ref.numel)
