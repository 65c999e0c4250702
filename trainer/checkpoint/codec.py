"""Split a nested state dict into flat tensors (for DCP planning) and a JSON skeleton.

Tensors (plain or DTensor) are lifted out under flat string keys; everything else must be
JSON-expressible (None, bool, int, float, str, and dicts/lists/tuples of those) and is kept in
a "skeleton" that records the exact container types, so that a tuple comes back a tuple and an
int dict key comes back an int. Nothing is ever pickled: a value of any other type is an error
that names its path.

Per-rank state (`rank_state`, e.g. RNG streams) uses the same skeleton with small tensors
inlined as base64, so it travels as one JSON file per rank.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainer.checkpoint.errors import CheckpointError

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
    )
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(f"tensor dtype {dtype} is not supported by the checkpoint format")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"checkpoint names unknown dtype {name!r}") from None


def _path_str(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _is_dtensor(t: Any) -> bool:
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
        if _is_dtensor(t):
            raise CheckpointError(f"rank_state at {_path_str(path)} holds a DTensor; pass it in `state`")
        t = t.detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}

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
