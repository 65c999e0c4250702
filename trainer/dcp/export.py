"""`ftsup ckpt export-dcp`: a checkpoint's tensors as a directory `torch.distributed.checkpoint.load` loads at any
world size, every byte verified as read, one chunk in memory at a time, renamed into place when complete.

Usage: docs/leaving.md.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem, metadata

from ftsup.store import dcpmeta, dtypes, hublayout, layout
from ftsup.store.errors import CheckpointError
from ftsup.trainer.checkpoint import codec, gcpause
from ftsup.trainer.checkpoint.shardio import PAGE, VerifiedFile, aligned_buffer, as_memoryview, read_files, round_up
from ftsup.trainer.hf.export import check_out, consistent, publish

DATA_NAME = "__0_0.distcp"  # DCP's name for the first data file of rank 0
METADATA_NAME = ".metadata"


def export_dcp(
    root: str | os.PathLike[str],
    step: int | None,
    out: str | os.PathLike[str],
    *,
    prefix: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write every tensor of checkpoint `step` (None: the latest consistent one) whose name starts with `prefix`
    under `out` as DCP writes a state dict, each under its name without `prefix`, in the chunks the ranks saved.
    Returns `{"step", "tensors", "bytes", "files"}`; `progress(done, total)`: tensor bytes written so far."""
    out = Path(out)
    check_out(out)
    found, ckpt, manifest = consistent(root, step)
    if manifest.metadata.get("format") == hublayout.TRAINER_FORMAT or layout.DCP_META_NAME not in manifest.files:
        raise CheckpointError(f"{ckpt} holds no engine tensors (a Trainer checkpoint: use ftsup ckpt export-hf)")
    meta = dcpmeta.read(ckpt, manifest)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        with gcpause.paused():
            summary = _write(ckpt, manifest, meta, prefix, tmp, progress)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"step": found, **summary}


def _write(
    ckpt: Path,
    manifest: layout.Manifest,
    meta: Mapping[str, Any],
    prefix: str,
    tmp: Path,
    progress: Callable[[int, int], None] | None,
) -> dict[str, Any]:
    storage: dict[str, list[Mapping[str, Any]]] = {}
    for s in meta["storage"]:
        storage.setdefault(s["fqn"], []).append(s)
    names = [k for k in dcpmeta.state_order(meta) if k.startswith(prefix) and len(k) > len(prefix)]
    if not names:
        raise CheckpointError(
            f"no tensor of {ckpt} has a name that starts with {prefix!r} (ftsup ckpt show lists them)"
        )
    itemsize = {k: dtypes.lookup(meta["tensors"][k]["dtype"], k).itemsize for k in names}
    sizes = {id(s): itemsize[k] * math.prod(s["sizes"]) for k in names for s in storage.get(k, [])}
    total, done = sum(sizes.values()), 0
    span = max(sizes.values(), default=0) + 2 * layout.CHECKSUM_BLOCK_BYTES  # widened to whole blocks at both ends
    arena = aligned_buffer(round_up(span, PAGE) + PAGE, populate=False)
    files: dict[str, VerifiedFile] = {}
    sd_meta: dict[str, Any] = {}
    where: dict[Any, Any] = {}
    with open(tmp / DATA_NAME, "xb") as f:
        for k in names:
            t = meta["tensors"][k]
            dtype = codec.dtype_from_name(t["dtype"], k)
            chunks = []
            for s in sorted(storage.get(k, []), key=lambda s: tuple(s["offsets"])):
                n = sizes[id(s)]
                value = torch.empty(tuple(s["sizes"]), dtype=dtype)
                if n:
                    vf = files.get(s["file"]) or files.setdefault(s["file"], _verified(ckpt, manifest, s))
                    ((base, region),) = read_files([(vf, [(s["byte_offset"], s["byte_offset"] + n)])], arena=arena)[0]
                    raw = region[s["byte_offset"] - base :][:n]
                    # Its own storage of exactly these bytes, no copy: torch.save writes a tensor's whole storage.
                    value = torch.frombuffer(as_memoryview(raw), dtype=dtype).reshape(tuple(s["sizes"]))
                offset = f.tell()
                torch.save(value, f)
                index = metadata.MetadataIndex(k[len(prefix) :], torch.Size(s["offsets"]))
                where[index] = filesystem._StorageInfo(DATA_NAME, offset, f.tell() - offset)
                chunks.append(metadata.ChunkStorageMetadata(torch.Size(s["offsets"]), torch.Size(s["sizes"])))
                done += n
                if progress is not None:
                    progress(done, total)
            props = metadata.TensorProperties(dtype=dtype)
            sd_meta[k[len(prefix) :]] = metadata.TensorStorageMetadata(props, torch.Size(t["size"]), chunks)
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / METADATA_NAME, "xb") as f:
        done_meta = metadata.Metadata(state_dict_metadata=sd_meta, storage_data=where)
        done_meta.version = filesystem.CURRENT_DCP_VERSION  # as DCP's writer records it
        pickle.dump(done_meta, f)
        f.flush()
        os.fsync(f.fileno())
    return {"tensors": len(names), "bytes": total, "files": [METADATA_NAME, DATA_NAME]}


def _verified(ckpt: Path, manifest: layout.Manifest, s: Mapping[str, Any]) -> VerifiedFile:
    return VerifiedFile.in_checkpoint(ckpt, manifest, s["file"], s["crc_file"])
