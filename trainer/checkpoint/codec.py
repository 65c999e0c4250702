"""Split a nested state dict into flat tensors (for DCP planning) and a typed JSON skeleton, never pickling; and the
one dtype table bound to torch dtypes (`DTYPES`).

Per-rank state uses the same skeleton, small tensors inlined as base64 (trainer/checkpoint/DESIGN.md, Modules).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftsup.store import dtypes
from ftsup.store.errors import CheckpointError


@dataclass(frozen=True)
class DType:
    """One dtype a checkpoint can hold: its torch dtype, the name the checkpoint records
    (`dcp_metadata.json`, inline rank state) and its safetensors name (None: safetensors has
    none, so a shard stores the chunk as raw bytes, `U8`, and an export refuses it)."""

    torch: torch.dtype
    name: str
    safetensors: str | None
    # Values per torch element in a safetensors shape: float4_e2m1fn_x2 packs two 4-bit values
    # in one byte, and safetensors counts the 4-bit values (its last dimension is twice torch's).
    packed: int = 1


def _bind(d: dtypes.CheckpointDType) -> DType:
    dtype = getattr(torch, d.name)
    if dtype.itemsize != d.itemsize:  # the torch-free table and torch must agree, or no size is right
        raise RuntimeError(f"ftsup.store.dtypes says {d.name} takes {d.itemsize} bytes, torch {dtype.itemsize}")
    return DType(dtype, d.name, d.safetensors, d.packed)


DTYPES: tuple[DType, ...] = tuple(_bind(d) for d in dtypes.CHECKPOINT)
"""The one dtype table of the project (`ftsup.store.dtypes.CHECKPOINT`, torch-free), each name bound
to its torch dtype: what save, load, the shard headers and the Hugging Face export use."""

_BY_TORCH = {d.torch: d for d in DTYPES}
_BY_NAME = {d.name: d for d in DTYPES}


def _of(dtype: torch.dtype, what: str | None) -> DType:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        where = f"{what}: " if what else ""
        raise CheckpointError(
            f"{where}tensor dtype {dtype} is not supported by the checkpoint format "
            f"(supported: {', '.join(d.name for d in DTYPES)})"
        ) from None


def dtype_name(dtype: torch.dtype, what: str | None = None) -> str:
    """The checkpoint's name of `dtype`; CheckpointError (naming `what`, a tensor) if it has none."""
    return _of(dtype, what).name


def dtype_from_name(name: object, what: str | None = None) -> torch.dtype:
    """The torch dtype a checkpoint names; CheckpointError (naming `what`) for an unknown name."""
    return _BY_NAME[dtypes.lookup(name, what).name].torch


def safetensors_header(dtype: torch.dtype, sizes: Sequence[int], what: str) -> tuple[str, list[int]] | None:
    """(safetensors dtype, shape) of a tensor of `dtype` and torch shape `sizes`; None when
    safetensors cannot describe it (a dtype it lacks, or a packed dtype without a dimension)."""
    d = _of(dtype, what)
    if d.safetensors is None or (d.packed > 1 and not sizes):
        return None
    shape = list(sizes)
    if d.packed > 1:
        shape[-1] *= d.packed
    return d.safetensors, shape


def _path_str(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def encode(obj: Any, on_tensor: Callable[[tuple[Any, ...], torch.Tensor], Any], path: tuple[Any, ...] = ()) -> Any:
    """The JSON skeleton of `obj`; each tensor leaf becomes ``{"T": on_tensor(path, t)}``."""
    if isinstance(obj, torch.Tensor):
        return {"T": on_tensor(path, obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(
                    f"state key {k!r} at {_path_str(path)} is a {type(k).__name__}; only str and int keys can be saved"
                )
            items.append([k, encode(v, on_tensor, (*path, k))])
        return {"d": items}
    if isinstance(obj, tuple):
        return {"t": [encode(v, on_tensor, (*path, i)) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return {"l": [encode(v, on_tensor, (*path, i)) for i, v in enumerate(obj)]}
    raise CheckpointError(
        f"state value at {_path_str(path)} has type {type(obj).__name__}, which cannot be saved "
        "without pickle; convert it to tensors or JSON-compatible values (checkpoints never pickle)"
    )


def decode(node: Any, on_tensor: Callable[[Any], Any]) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise CheckpointError(f"malformed checkpoint skeleton node {node!r:.80}")
    ((tag, val),) = node.items()
    if tag == "v":
        return val
    if tag == "T":
        return on_tensor(val)
    if tag == "d":
        return {k: decode(v, on_tensor) for k, v in val}
    if tag == "t":
        return tuple(decode(v, on_tensor) for v in val)
    if tag == "l":
        return [decode(v, on_tensor) for v in val]
    raise CheckpointError(f"malformed checkpoint skeleton tag {tag!r}")


def is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` with every Stateful value (model, optimizer, ...) replaced by its state_dict()."""
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """(flat tensors by key, skeleton). Keys are dotted paths; a collision is an error."""
    flat: dict[str, torch.Tensor] = {}

    def lift(path: tuple[Any, ...], t: torch.Tensor) -> str:
        key = _path_str(path)
        dtype_name(t.dtype, key)  # an unsupported dtype is refused here, naming the tensor, before any planning
        if key in flat:
            raise CheckpointError(f"two state entries flatten to the same key {key!r}; rename one")
        flat[key] = t
        return key

    skeleton = encode(dict(state), lift)
    return flat, skeleton


def rebuild(skeleton: Any, tensors: Mapping[str, Any]) -> Any:
    return decode(skeleton, lambda key: tensors[key])


# --------------------------------------------------------------------------- per-rank state


def encode_inline(obj: Any) -> Any:
    """Skeleton with small tensors inlined (dtype, shape, base64 of the raw bytes)."""

    def inline(path: tuple[Any, ...], t: torch.Tensor) -> dict[str, Any]:
        if is_dtensor(t):
            raise CheckpointError(f"rank_state at {_path_str(path)} holds a DTensor; pass it in `state`")
        name = dtype_name(t.dtype, f"rank_state at {_path_str(path)}")
        t = t.detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"dtype": name, "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}

    return encode(obj, inline)


def decode_inline(skeleton: Any) -> Any:
    def restore(spec: dict[str, Any]) -> torch.Tensor:
        try:
            dtype = dtype_from_name(spec["dtype"])
            raw = bytearray(base64.b64decode(spec["b64"], validate=True))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(spec["shape"]).clone()
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise CheckpointError(f"rank_state holds a malformed inline tensor ({e})") from None

    return decode(skeleton, restore)
