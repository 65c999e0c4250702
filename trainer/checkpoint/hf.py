"""Export a checkpoint's model weights as Hugging Face sharded safetensors.

    ftsup ckpt export-hf DIR --step N OUT

writes `OUT/model-0000k-of-0000n.safetensors` and `OUT/model.safetensors.index.json`
(`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`), the layout
`transformers` loads with `from_pretrained`. Whatever world size saved the checkpoint, each
tensor is assembled whole from its saved chunks. The checkpoint is deep-verified first, so a
corrupt one is never exported, and OUT appears only when complete (written beside it, renamed).

Only the model's tensors are exported: the keys under the state's `model` entry (for
`TrainingState` that is `train.model.`, for `ModelOptimState` `app.model.`), found
automatically or given with `--prefix`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ftsup.store import layout
from ftsup.store.errors import CheckpointCorruptError, CheckpointError
from ftsup.trainer.checkpoint import codec
from ftsup.trainer.checkpoint.loading import read_dcp_metadata

INDEX_NAME = "model.safetensors.index.json"


def model_prefix(keys: list[str]) -> str:
    """The one prefix that ends in `model.` for the model's tensors (e.g. `train.model.`)."""
    found = {m.group(1) for k in keys if (m := re.match(r"^((?:[^.]+\.)*?model\.)", k))}
    if len(found) != 1:
        raise CheckpointError(
            f"cannot tell which tensors are the model's (candidate prefixes: {sorted(found) or 'none'}); pass --prefix"
        )
    return found.pop()


def _read_meta(ckpt: Path, manifest: layout.Manifest) -> dict[str, Any]:
    return read_dcp_metadata(ckpt, manifest)  # verified, its schema checked


def assemble(ckpt: Path, meta: Mapping[str, Any], fqn: str) -> torch.Tensor:
    """One whole tensor, from every chunk of it in the shard files."""
    t = meta["tensors"][fqn]
    dtype = codec.dtype_from_name(t["dtype"], fqn)
    full = torch.empty(t["size"], dtype=dtype)
    for s in meta["storage"]:
        if s["fqn"] != fqn or s["nbytes"] == 0:
            continue
        path = layout.resolve_inside(ckpt, s["file"])
        with open(path, "rb") as f:
            f.seek(s["byte_offset"])
            raw = bytearray(f.read(s["nbytes"]))
        if len(raw) != s["nbytes"]:
            raise CheckpointCorruptError(f"{s['file']}: ends inside {fqn}", path=str(ckpt), file=s["file"])
        chunk = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(s["sizes"])
        view = full
        for dim, (o, n) in enumerate(zip(s["offsets"], s["sizes"], strict=True)):
            view = view.narrow(dim, o, n)
        view.copy_(chunk)
    return full


def _header_entry(name: str, dtype: torch.dtype, shape: list[int]) -> tuple[str, list[int]]:
    """The safetensors dtype and shape of one exported tensor; CheckpointError naming it when
    safetensors cannot store it."""
    entry = codec.safetensors_header(dtype, shape, name)
    if entry is None:
        dims = "" if shape else " (0-dimensional)"
        raise CheckpointError(
            f"tensor {name!r} has dtype {codec.dtype_name(dtype)}{dims}, which safetensors cannot store; "
            "convert it (or leave it out with --prefix) before exporting"
        )
    return entry


def _write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        st_dtype, shape = _header_entry(name, t.dtype, list(t.shape))
        header[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as safetensors' own writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in tensors:
            if t.numel():
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return pos


def export_hf(root: str | os.PathLike[str], step: int | None, out: str | os.PathLike[str], *,
              prefix: str | None = None, max_shard_bytes: int = 5 * 10**9) -> dict[str, Any]:  # fmt: skip
    """Write the model of checkpoint `step` (None: latest consistent) to `out`; returns the index."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new directory")
    info = layout.find_checkpoint(root, step, deep=True)
    if not info.consistent:
        raise CheckpointCorruptError(
            f"checkpoint {info.path} is not consistent: {'; '.join(map(str, info.problems))}", path=info.path
        )
    ckpt = Path(info.path)
    meta = _read_meta(ckpt, layout.read_manifest(ckpt))
    keys = sorted(meta["tensors"])
    prefix = prefix if prefix is not None else model_prefix(keys)
    names = [k for k in keys if k.startswith(prefix)]
    if not names:
        raise CheckpointError(f"no tensor in {ckpt} starts with {prefix!r}")
    # Greedy sharding in name order, as transformers' save_pretrained does.
    shards: list[list[str]] = [[]]
    size = 0
    for k in names:
        t = meta["tensors"][k]
        dtype = codec.dtype_from_name(t["dtype"], k)
        _header_entry(k[len(prefix) :], dtype, list(t["size"]))  # refused before anything is written
        n = dtype.itemsize * math.prod(t["size"])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    try:
        for i, group in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = [(k[len(prefix) :], assemble(ckpt, meta, k)) for k in group]
            total += _write_safetensors(tmp / fname, tensors)
            weight_map.update({name: fname for name, _ in tensors})
        index = {"metadata": {"total_size": total, "ftsup_step": info.step}, "weight_map": weight_map}
        layout.write_file_durable(tmp / INDEX_NAME, json.dumps(index, indent=2).encode())
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index
