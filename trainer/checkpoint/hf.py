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

`OUT/config.json`, which `AutoModelForCausalLM.from_pretrained(OUT)` needs, is the model config the
checkpoint holds (its metadata's `config`, when that is a `transformers` config: it names a
`model_type`; `TrainingState(config=hf_config.to_dict())` saves one) or, given, `--config FILE`
(which wins). Without either the weights are exported alone, and the caller is told.

A checkpoint that `FtsupCallback` committed (metadata `format: hf-trainer`) holds the Trainer's
`save_pretrained` output already: its weights (`model*.safetensors`, the index when sharded),
`config.json` and `generation_config.json` are copied as they are, each checked against the
manifest's checksum as it is copied.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ftsup.store import checksums, layout, safefile
from ftsup.store.errors import CheckpointCorruptError, CheckpointError
from ftsup.trainer.checkpoint import codec
from ftsup.trainer.checkpoint.loading import read_dcp_metadata

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
CONFIG_MAX_BYTES = 16 << 20  # a model config is a few KiB; tokenizer-sized vocabularies stay far below this
HEADER_MAX_BYTES = 100 << 20  # safetensors' own limit on a header
TRAINER_FORMAT = "hf-trainer"  # ftsup.trainer.hf_store.FORMAT (that module's import would pull in no more than this)
_TRAINER_EXPORTED = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                               r"config\.json|generation_config\.json)$")  # fmt: skip
INDEX_MAX_BYTES = 64 << 20  # a sharded model's index: one line per tensor
_COPY_CHUNK = 64 << 20  # a multiple of the checksum block


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A model config given on the command line: a regular file of at most CONFIG_MAX_BYTES holding a
    JSON object (a link to one is followed: the path is the caller's own)."""
    what = f"--config {path}"
    real = Path(path).resolve()
    obj = safefile.read_json(real, what, CONFIG_MAX_BYTES, error=CheckpointError)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{what}: a model config is a JSON object, not {type(obj).__name__}")
    return obj


def checkpoint_config(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The transformers model config a checkpoint's metadata holds, if any (one that names its
    `model_type`; any other config, such as the reference trainer's, is not one `from_pretrained` reads)."""
    config = metadata.get("config")
    if isinstance(config, dict) and isinstance(config.get("model_type"), str):
        return config
    return None


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
              prefix: str | None = None, max_shard_bytes: int = 5 * 10**9,
              config: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Write the model of checkpoint `step` (None: latest consistent) to `out`; returns the index,
    whose metadata says where `config.json` came from (`config`: "file", "checkpoint" or None)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new directory")
    info = layout.find_checkpoint(root, step, deep=True)
    if not info.consistent:
        raise CheckpointCorruptError(
            f"checkpoint {info.path} is not consistent: {'; '.join(map(str, info.problems))}", path=info.path
        )
    ckpt = Path(info.path)
    manifest = layout.read_manifest(ckpt)
    trainer = manifest.metadata.get("format") == TRAINER_FORMAT
    if trainer and prefix is not None:
        raise CheckpointError(
            f"{ckpt} is a Trainer checkpoint: its weights are exported as saved; --prefix does not apply"
        )
    write = None if trainer else _plan_engine_export(ckpt, manifest, prefix, max_shard_bytes)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        index = _copy_trainer_export(ckpt, manifest, tmp) if write is None else write(tmp)
        source = None
        if config is not None:
            source = "file"
            (tmp / CONFIG_NAME).unlink(missing_ok=True)  # the Trainer's copy: the file given wins
            layout.write_file_durable(tmp / CONFIG_NAME, json.dumps(dict(config), indent=2).encode())
        elif (tmp / CONFIG_NAME).exists():
            source = "checkpoint"  # the Trainer's own
        elif (saved := checkpoint_config(manifest.metadata)) is not None:
            source = "checkpoint"
            layout.write_file_durable(tmp / CONFIG_NAME, json.dumps(saved, indent=2).encode())
        index["metadata"].update(ftsup_step=info.step, config=source)
        layout.fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def _plan_engine_export(
    ckpt: Path, manifest: layout.Manifest, prefix: str | None, max_shard_bytes: int
) -> Callable[[Path], dict[str, Any]]:
    """Check what an engine checkpoint's export writes (refusing a dtype safetensors lacks before
    anything is written) and return the function that writes it into a directory."""
    meta = _read_meta(ckpt, manifest)
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

    def write(tmp: Path) -> dict[str, Any]:
        weight_map: dict[str, str] = {}
        total = 0
        for i, group in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = [(k[len(prefix) :], assemble(ckpt, meta, k)) for k in group]
            total += _write_safetensors(tmp / fname, tensors)
            weight_map.update({name: fname for name, _ in tensors})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        layout.write_file_durable(tmp / INDEX_NAME, json.dumps(index, indent=2).encode())
        return index

    return write


def _copy_trainer_export(ckpt: Path, manifest: layout.Manifest, tmp: Path) -> dict[str, Any]:
    """Copy a Trainer checkpoint's save_pretrained files, each verified as it is copied; the index
    (of the one weights file, when not sharded) is read from what was copied."""
    names = sorted(n for n in manifest.files if _TRAINER_EXPORTED.match(n))
    weights = [n for n in names if n.endswith(".safetensors")]
    if not weights:
        raise CheckpointError(f"{ckpt} holds no safetensors weights (saved with save_safetensors=False?)")
    for name in names:
        _copy_verified(ckpt, name, manifest.files[name], manifest.checksum_algorithm, tmp / name)
    if INDEX_NAME in names:
        index = safefile.read_json(tmp / INDEX_NAME, f"{ckpt}/{INDEX_NAME}", INDEX_MAX_BYTES)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointCorruptError(f"{ckpt}/{INDEX_NAME}: no weight_map", path=str(ckpt), file=INDEX_NAME)
        index.setdefault("metadata", {})
        return index
    header = _safetensors_header(tmp / weights[0], f"{ckpt}/{weights[0]}")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    total = max((v["data_offsets"][1] for v in tensors.values() if isinstance(v, dict)), default=0)
    return {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(tensors, weights[0])}


def _copy_verified(ckpt: Path, rel: str, entry: layout.FileEntry, algorithm: str, dest: Path) -> None:
    fd = safefile.open_regular(layout.resolve_inside(ckpt, rel), f"{ckpt}/{rel}")
    crcs: list[int] = []
    size = 0
    with open(fd, "rb", buffering=0) as src, open(dest, "xb") as dst:
        buf = bytearray(_COPY_CHUNK)
        view = memoryview(buf)
        while True:
            n = 0
            while n < len(buf) and (got := src.readinto(view[n:])):
                n += got
            checksums.block_crcs(view[:n], crcs, algorithm)
            dst.write(view[:n])
            size += n
            if n < len(buf):
                break
        dst.flush()
        os.fsync(dst.fileno())
    if size != entry.size or checksums.checksum_from_block_crcs(crcs, algorithm) != entry.checksum:
        raise CheckpointCorruptError(f"{ckpt}/{rel}: changed since it was verified", path=str(ckpt), file=rel)


def _safetensors_header(path: Path, what: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= HEADER_MAX_BYTES:
            raise CheckpointCorruptError(f"{what}: not a safetensors file (header length {n})", path=what)
        raw = f.read(n)
    header = safefile.loads(raw, what)
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{what}: a safetensors header is a JSON object", path=what)
    return header
