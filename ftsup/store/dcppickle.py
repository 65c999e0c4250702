"""The two pickles a DCP checkpoint holds, read without running them: `.metadata` and a chunk archive's `data.pkl`.

Each global a pickle names maps to an inert stand-in from a short list, anything else is refused; nothing is
imported or called (ftsup/store/DESIGN.md, DCP checkpoints). Stdlib only.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

from ftsup.store import dtypes
from ftsup.store.errors import CheckpointError

_DCP = "torch.distributed.checkpoint.metadata"
_SHARD = "torch.distributed._shard.sharded_tensor.metadata"  # where TensorProperties lived before torch 2.2


class Record:
    """A stand-in for one of DCP's metadata classes: NEWOBJ makes it, BUILD hands it its state; no code of the
    class it stands for ever runs."""

    kind = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # REDUCE with the class itself: no call of ours runs
        pass

    args: tuple[Any, ...]
    state: Any

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _record(kind: str) -> type[Record]:
    return type(f"Stand_{kind}", (Record,), {"kind": kind})


class DType:
    """A torch dtype, by its name (`float32`)."""

    def __init__(self, name: str) -> None:
        self.name = name


class Size(tuple):  # type: ignore[type-arg]
    """A torch.Size: a tuple of ints."""


class Storage:
    """A storage a tensor's pickle refers to by persistent id: its key in the archive, dtype and element count."""

    def __init__(self, key: str, dtype: str, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class TensorRecord:
    """What `torch._utils._rebuild_tensor_v2/v3` would have been called with."""

    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None) -> None:
        self.storage, self.offset, self.size, self.stride, self.dtype = storage, offset, size, stride, dtype


class Layout:
    def __init__(self, name: str) -> None:
        self.name = name


class MemoryFormat:
    def __init__(self, value: Any) -> None:
        self.value = value


def _size(*args: Any) -> Size:
    if len(args) > 1:
        raise CheckpointError("torch.Size called with more than one argument")
    items = tuple(args[0]) if args else ()
    if len(items) > 64 or not all(type(i) is int for i in items):
        raise CheckpointError("a torch.Size that is not a short tuple of integers")
    return Size(items)


def _layout(name: Any) -> Layout:
    if name != "torch.strided":
        raise CheckpointError(f"tensor layout {name!r:.60} (only torch.strided is read)")
    return Layout(name)


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise CheckpointError("a path made of something other than strings")
    return "/".join(parts)


def _ordered_dict(*args: Any) -> dict[Any, Any]:
    if args:
        raise CheckpointError("an OrderedDict pickled with contents")
    return {}


DCP_CLASSES: dict[tuple[str, str], Any] = {
    (module, name): _record(name)
    for module, names in (
        (
            _DCP,
            (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
            ),
        ),
        ("torch.distributed.checkpoint.filesystem", ("_StorageInfo",)),
        (_SHARD, ("TensorProperties",)),
    )
    for name in names
}
"""DCP's metadata classes, each to a stand-in of its own name (`Record.kind`)."""

_DCP_CALLABLES: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    (_DCP, "_MEM_FORMAT_ENCODING"): MemoryFormat,
    (_SHARD, "MEM_FORMAT_ENCODING"): MemoryFormat,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("collections", "OrderedDict"): _ordered_dict,
}

_STORAGE_DTYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
"""torch.save's typed storage names and the dtype each holds; `UntypedStorage` holds bytes (v3 names the dtype)."""


class _StorageType:
    def __init__(self, dtype: str | None) -> None:
        self.dtype = dtype  # None: untyped (bytes)


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRecord:
    if len(rest) > 3:
        raise CheckpointError("_rebuild_tensor_v2 called with too many arguments")
    return TensorRecord(storage, offset, size, stride, None)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *rest: Any
) -> TensorRecord:
    if len(rest) > 1 or not isinstance(dtype, DType):
        raise CheckpointError("_rebuild_tensor_v3 called with arguments torch.save does not write")
    return TensorRecord(storage, offset, size, stride, dtype.name)


_TENSOR_CALLABLES: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGE_DTYPES.items()},
}


class _Unpickler(pickle.Unpickler):
    """`pickle.Unpickler` that finds only the globals of `allowed` (and dtypes by name), and no persistent id."""

    def __init__(self, raw: bytes, allowed: dict[tuple[str, str], Any], what: str) -> None:
        super().__init__(io.BytesIO(raw))
        self.allowed = allowed
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in dtypes.BY_NAME:
            return DType(name)
        found = self.allowed.get((module, name))
        if found is None:
            raise CheckpointError(
                f"{self.what}: names {module}.{name:.80}, which is not one of the classes it may hold"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.what}: holds a persistent id, which it may not")


class _TensorUnpickler(_Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        ok = isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
        if not ok or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str) or type(pid[4]) is not int:
            raise CheckpointError(f"{self.what}: a storage reference torch.save does not write")
        return Storage(pid[2], pid[1].dtype or "", pid[4])


def _load(unpickler: pickle.Unpickler, what: str) -> Any:
    try:
        return unpickler.load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"{what}: truncated or not a pickle ({e})") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as e:
        raise CheckpointError(f"{what}: not a pickle DCP writes ({type(e).__name__}: {e})") from None
    except RecursionError:
        raise CheckpointError(f"{what}: nested too deep") from None


def load_metadata(raw: bytes, what: str) -> Any:
    """The object `.metadata` holds, made of stand-ins (`Record`, `Size`, `DType`, ...), dicts, lists and scalars;
    CheckpointError naming `what` for any other global, a persistent id, or a pickle cut short."""
    return _load(_Unpickler(raw, {**DCP_CLASSES, **_DCP_CALLABLES}, what), what)


def load_tensor(raw: bytes, what: str) -> TensorRecord:
    """The tensor record of a torch.save archive's `data.pkl` (one tensor, as DCP saves each chunk)."""
    obj = _load(_TensorUnpickler(raw, _TENSOR_CALLABLES, what), what)
    if not isinstance(obj, TensorRecord):
        raise CheckpointError(f"{what}: holds a {type(obj).__name__}, not one tensor")
    if not isinstance(obj.storage, Storage):
        raise CheckpointError(f"{what}: a tensor without a storage of the archive")
    if obj.dtype is None:  # v2: the storage's type names the dtype
        obj.dtype = obj.storage.dtype
    if not obj.dtype:
        raise CheckpointError(f"{what}: an untyped storage and no dtype")
    return obj
