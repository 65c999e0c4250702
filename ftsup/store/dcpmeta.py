"""The schema of `dcp_metadata.json`, checked before any byte offset in it reaches a reader.

A file that fails is a corrupt checkpoint (ftsup/store/DESIGN.md, A hostile store). Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ftsup.store import dtypes, layout, safefile
from ftsup.store.errors import CheckpointCorruptError, CheckpointError, DurableTierError

_MAX_DIMS = 64
_MAX_ELEMENTS = 1 << 62


def read(path: Path, manifest: layout.Manifest) -> dict[str, Any]:
    """A checkpoint's `dcp_metadata.json`, verified against the manifest (size, checksum) and its schema
    checked; raises CheckpointCorruptError naming what is wrong."""
    raw = layout.read_verified(path, manifest, layout.DCP_META_NAME, layout.DCP_META_MAX_BYTES)
    return parse(raw, manifest, f"{path}/{layout.DCP_META_NAME}")


def problems(manifest: layout.Manifest, read: Callable[[], object]) -> list[layout.Problem]:
    """The loader's checks of a checkpoint's `dcp_metadata.json` (where its manifest names one), as a verifier
    reports them: `read()` reads and checks it as the loader does (`read` here, `tiers.read_dcp_metadata` for a
    durable tier); [] when it passes, else the one problem. A tier that fails raises (DurableTierError)."""
    if layout.DCP_META_NAME not in manifest.files:
        return []
    try:
        read()
    except DurableTierError:
        raise
    except CheckpointError as e:
        return [layout.Problem(layout.DCP_META_NAME, str(e))]
    return []


def parse(raw: bytes, manifest: layout.Manifest, where: str) -> dict[str, Any]:
    """`dcp_metadata.json`'s bytes (already verified against the manifest: from a store, or from a durable tier)
    parsed and their schema checked; raises CheckpointCorruptError naming what is wrong."""
    meta = safefile.loads(raw, where, max_values=layout.DCP_META_MAX_BYTES // 8)
    validate(meta, manifest, lambda name: dtypes.lookup(name).itemsize, where)
    return dict(meta)


def validate(meta: Any, manifest: layout.Manifest, itemsize: Callable[[str], int], where: str) -> None:
    """Raise CheckpointCorruptError naming the first thing wrong in the parsed `meta`.
    `itemsize(dtype_name)` returns the element size, or raises CheckpointError for an unknown one."""
    try:
        _validate(meta, manifest, itemsize)
    except CheckpointCorruptError:
        raise
    except CheckpointError as e:
        raise CheckpointCorruptError(f"{where}: {e}", file=layout.DCP_META_NAME) from None
    except _Invalid as e:
        raise CheckpointCorruptError(f"{where}: {e}", file=layout.DCP_META_NAME) from None


class _Invalid(Exception):
    pass


def _validate(meta: Any, manifest: layout.Manifest, itemsize: Callable[[str], int]) -> None:
    top = _obj(meta, "the top level", ("tensors", "storage", "skeleton"))
    tensors = _obj(top["tensors"], "tensors")
    declared: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    sizes_of: dict[str, int] = {}
    for fqn, t in tensors.items():
        where = f"tensors[{fqn!r:.80}]"
        t = _obj(t, where, ("dtype", "size", "chunks"))
        if not isinstance(t["dtype"], str):
            raise _Invalid(f"{where}.dtype is not a string")
        sizes_of[fqn] = itemsize(t["dtype"])
        size = _dims(t["size"], f"{where}.size", None)
        ndim = len(size)
        for i, c in enumerate(_list(t["chunks"], f"{where}.chunks")):
            # The well-formed chunk the engine writes takes the short way; anything else the full checks, which
            # name what is wrong (as `layout.parse_manifest` does, `ftsup/store/DESIGN.md`).
            offsets = lengths = None
            if type(c) is dict and "offsets" in c and "sizes" in c:
                offsets, lengths = _quick_dims(c["offsets"], ndim), _quick_dims(c["sizes"], ndim)
            if offsets is None or lengths is None:
                c = _obj(c, f"{where}.chunks[{i}]", ("offsets", "sizes"))
                offsets = _dims(c["offsets"], f"{where}.chunks[{i}].offsets", ndim)
                lengths = _dims(c["sizes"], f"{where}.chunks[{i}].sizes", ndim)
            if any(o + n > s for o, n, s in zip(offsets, lengths, size, strict=True)):
                raise _Invalid(f"{where}.chunks[{i}] reaches past the tensor's size {list(size)}")
            if (fqn, offsets) in declared:
                raise _Invalid(f"{where} declares the chunk at {list(offsets)} twice")
            declared[(fqn, offsets)] = lengths
    stored: set[tuple[str, tuple[int, ...]]] = set()
    good_files: set[str] = set()
    for i, s in enumerate(_list(top["storage"], "storage")):
        where = f"storage[{i}]"
        s = _obj(s, where, ("fqn", "offsets", "sizes", "file", "crc_file", "byte_offset"))
        fqn = s["fqn"]
        if not isinstance(fqn, str) or fqn not in tensors:
            raise _Invalid(f"{where}.fqn {fqn!r:.80} is not a tensor of this checkpoint")
        offsets = _quick_dims(s["offsets"], None) or _dims(s["offsets"], f"{where}.offsets", None)
        lengths = _quick_dims(s["sizes"], None) or _dims(s["sizes"], f"{where}.sizes", None)
        if declared.get((fqn, offsets)) != lengths:
            raise _Invalid(f"{where} stores a chunk of {fqn!r:.80} its tensor does not declare")
        if (fqn, offsets) in stored:
            raise _Invalid(f"{where} stores the chunk of {fqn!r:.80} at {list(offsets)} a second time")
        stored.add((fqn, offsets))
        nbytes = sizes_of[fqn]
        for n in lengths:
            nbytes *= n
        if "nbytes" in s and s["nbytes"] != nbytes:
            raise _Invalid(f"{where}.nbytes {s['nbytes']!r:.40} != {nbytes} for its sizes and dtype")
        # A shard file is named by each of its chunks: its name is checked once (the first entry naming a bad one
        # fails, as when every entry's was checked).
        shard, crc = s["file"], s["crc_file"]
        if type(shard) is not str or shard not in good_files:
            good_files.add(_file(shard, f"{where}.file", manifest))
        if type(crc) is not str or crc not in good_files:
            good_files.add(_file(crc, f"{where}.crc_file", manifest))
        blocks = -(-manifest.files[shard].size // layout.CHECKSUM_BLOCK_BYTES)
        if manifest.files[crc].size != 4 * blocks:
            raise _Invalid(f"{where}.crc_file {crc} is not the block checksum list of {shard}")
        offset = s["byte_offset"]
        if type(offset) is not int or offset < 0 or offset + nbytes > manifest.files[shard].size:
            raise _Invalid(
                f"{where}.byte_offset {offset!r:.40} + {nbytes} bytes is not inside {shard} "
                f"({manifest.files[shard].size} bytes)"
            )
    missing = sorted(set(declared) - stored)
    if missing:
        fqn, offsets = missing[0]
        raise _Invalid(f"the chunk of {fqn!r:.80} at {list(offsets)} is stored nowhere ({len(missing)} such chunks)")
    _skeleton(top["skeleton"], set(tensors))


def state_order(meta: Mapping[str, Any]) -> list[str]:
    """The tensors of checkpointed (checked) `meta` in the order the saved state held them: its skeleton's
    (`tensors` is in the order of DCP's plan, which on several ranks puts each rank's share first)."""
    order: list[str] = []
    stack = [meta["skeleton"]]
    while stack:
        ((tag, val),) = stack.pop().items()
        if tag == "T":
            order.append(val)
        elif tag == "d":
            stack.extend(reversed([node for _, node in val]))
        elif tag in ("t", "l"):
            stack.extend(reversed(val))
    seen = set(order)
    return [k for k in dict.fromkeys(order) if k in meta["tensors"]] + [k for k in meta["tensors"] if k not in seen]


def _skeleton(root: Any, tensors: set[str]) -> None:
    """The node kinds `codec.encode` writes ({"v": scalar}, {"T": key}, {"d": [[k, node]...]},
    {"t": [...]}, {"l": [...]}), walked without recursion."""
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or len(node) != 1:
            raise _Invalid(f"skeleton node {node!r:.80} is not a one-key object")
        ((tag, val),) = node.items()
        if tag == "v":
            if val is not None and not isinstance(val, (bool, int, float, str)):
                raise _Invalid(f"skeleton value {val!r:.80} is not a scalar")
        elif tag == "T":
            if not isinstance(val, str) or val not in tensors:
                raise _Invalid(f"skeleton names tensor {val!r:.80}, which is not stored")
        elif tag == "d":
            for item in _list(val, "a skeleton dict"):
                if not isinstance(item, list) or len(item) != 2 or type(item[0]) not in (str, int):
                    raise _Invalid(f"skeleton dict item {item!r:.80} is not [str or int key, node]")
                stack.append(item[1])
        elif tag in ("t", "l"):
            stack.extend(_list(val, "a skeleton sequence"))
        else:
            raise _Invalid(f"skeleton tag {tag!r:.20} is not one the format writes")


def _obj(x: Any, where: str, keys: tuple[str, ...] = ()) -> Mapping[str, Any]:
    if not isinstance(x, dict):
        raise _Invalid(f"{where} is not an object")
    for k in keys:
        if k not in x:
            raise _Invalid(f"{where} has no '{k}'")
    return x


def _list(x: Any, where: str) -> list[Any]:
    if not isinstance(x, list):
        raise _Invalid(f"{where} is not a list")
    return x


def _dims(x: Any, where: str, ndim: int | None) -> tuple[int, ...]:
    dims = _list(x, where)
    if len(dims) > _MAX_DIMS or (ndim is not None and len(dims) != ndim):
        raise _Invalid(f"{where} has {len(dims)} dimensions" + (f", not {ndim}" if ndim is not None else ""))
    total = 1
    for d in dims:
        if type(d) is not int or d < 0:
            raise _Invalid(f"{where} holds {d!r:.40}, not an integer >= 0")
        total *= max(d, 1)
        if total > _MAX_ELEMENTS:
            raise _Invalid(f"{where} is impossibly large")
    return tuple(dims)


def _quick_dims(x: Any, ndim: int | None) -> tuple[int, ...] | None:
    """`x` as `_dims` returns it when it is a list of `ndim` (any when None; at most 2) small non-negative ints
    (no product can reach `_MAX_ELEMENTS`), else None (or an empty tuple): `_dims` then names what is wrong, or
    takes it."""
    if type(x) is not list or len(x) > 2 or (ndim is not None and len(x) != ndim):
        return None
    for d in x:
        if type(d) is not int or not 0 <= d < 1 << 31:
            return None
    return tuple(x)


def _file(name: Any, where: str, manifest: layout.Manifest) -> str:
    if not isinstance(name, str):
        raise _Invalid(f"{where} is not a string")
    try:
        layout.validate_relpath(name)
    except CheckpointError as e:
        raise _Invalid(f"{where}: {e}") from None
    if name not in manifest.files:
        raise _Invalid(f"{where} {name!r:.80} is not a file of the manifest")
    return name
