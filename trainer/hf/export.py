"""`ftsup ckpt export-hf`: a checkpoint's model (an engine checkpoint's or a Trainer checkpoint's weights) in the
Hugging Face Hub's layout, every byte verified as read, into a directory renamed into place when complete.

Usage: docs/hf.md; how: trainer/checkpoint/DESIGN.md, Export.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ftsup.store import checksums, dcpmeta, dtypes, hublayout, layout, safefile
from ftsup.store.errors import CheckpointCorruptError, CheckpointError
from ftsup.trainer.checkpoint import codec, gcpause
from ftsup.trainer.checkpoint.shardio import PAGE, VerifiedFile, aligned_buffer, read_files, round_up
from ftsup.trainer.hf.hubread import HubReader
from ftsup.trainer.hf.write import OutTensor, check, plan, write_model, write_new

INDEX_NAME = hublayout.INDEX_NAME
CONFIG_NAME = hublayout.CONFIG_NAME
GENERATION_CONFIG_NAME = "generation_config.json"
BATCH_BYTES = 16 << 20  # the arena of an engine checkpoint's reads (a larger tensor is read alone)
_TRAINER_WEIGHTS = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json)$")


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A model config given on the command line: a regular file of at most CONFIG_MAX_BYTES holding a
    JSON object (a link to one is followed: the path is the caller's own)."""
    what = f"--config {path}"
    obj = safefile.read_json(Path(path).resolve(), what, hublayout.CONFIG_MAX_BYTES, error=CheckpointError)
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


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a checkpoint dtype name (`bfloat16`): for a caller without torch (the CLI)."""
    return codec.dtype_from_name(name)


def cast_target(dtype: torch.dtype | None, saved: torch.dtype) -> torch.dtype:
    """The dtype a tensor saved as `saved` is written in when the export converts to `dtype`."""
    return dtype if dtype is not None and codec.dtype_name(saved) in dtypes.CASTABLE else saved


def export_hf(
    root: str | os.PathLike[str],
    step: int | None,
    out: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    max_shard_bytes: int = hublayout.DEFAULT_MAX_SHARD_BYTES,
    config: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write the model of checkpoint `step` (None: the latest consistent one) to `out`; returns the
    index, whose metadata adds the step and where `config.json` came from (`config`: "file",
    "checkpoint" or None). `progress(done, total)`: bytes written so far, after each tensor."""
    out = Path(out)
    if dtype is not None and codec.dtype_name(dtype) not in dtypes.CAST_NAMES.values():
        raise CheckpointError(f"cannot export as {dtype}: the choices are {', '.join(dtypes.CAST_NAMES)}")
    check_out(out)
    found, ckpt, manifest = consistent(root, step)
    trainer = manifest.metadata.get("format") == hublayout.TRAINER_FORMAT
    if trainer and prefix is not None:
        raise CheckpointError(f"{ckpt} is a Trainer checkpoint: its weights are its model's; --prefix does not apply")
    with ExitStack() as stack:
        stack.enter_context(gcpause.paused())  # a full collection is a large part of an export's time
        if trainer:
            tensors, saved_config = _trainer_tensors(ckpt, manifest, dtype, stack)
        else:
            tensors, saved_config = _engine_tensors(ckpt, manifest, prefix, dtype, max_shard_bytes), None
        check(tensors)  # a dtype safetensors lacks is refused before anything is written

        def configs(tmp: Path, index: dict[str, Any]) -> None:
            data, source = _config(config, saved_config, checkpoint_config(manifest.metadata), dtype)
            if data is not None:
                write_new(tmp / CONFIG_NAME, data)
            if trainer and GENERATION_CONFIG_NAME in manifest.files:
                raw = layout.read_verified(ckpt, manifest, GENERATION_CONFIG_NAME, hublayout.CONFIG_MAX_BYTES)
                write_new(tmp / GENERATION_CONFIG_NAME, raw)
            index["metadata"].update(ftsup_step=found, config=source)

        return write_published(out, tensors, max_shard_bytes, progress, configs)


def write_published(
    out: Path,
    tensors: Sequence[OutTensor],
    max_shard_bytes: int,
    progress: Callable[[int, int], None] | None,
    more: Callable[[Path, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """`tensors` written in the Hub's layout into a private directory beside `out`, then `more(directory, index)` (other
    files, the index's metadata), then renamed onto `out`: it appears whole or not at all. Returns the index;
    `progress(bytes done, bytes in all)`."""
    total, done = sum(t.nbytes for t in tensors), [0]

    def advance(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        index = write_model(tmp, tensors, max_shard_bytes, advance)
        if more is not None:
            more(tmp, index)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def _config(
    given: Mapping[str, Any] | None,
    trainer: tuple[dict[str, Any], bytes] | None,
    metadata: Mapping[str, Any] | None,
    dtype: torch.dtype | None,
) -> tuple[bytes | None, str | None]:
    """config.json's bytes and where they came from: the file given, the Trainer's (its bytes as saved,
    unless converted), the checkpoint's metadata, or none."""
    if given is not None:
        return _config_bytes(given, dtype), "file"
    if trainer is not None:
        return (trainer[1] if dtype is None else _config_bytes(trainer[0], dtype)), "checkpoint"
    if metadata is not None:
        return _config_bytes(metadata, dtype), "checkpoint"
    return None, None


def _config_bytes(config: Mapping[str, Any], dtype: torch.dtype | None) -> bytes:
    config = dict(config)
    if dtype is not None:  # what from_pretrained(dtype="auto") loads the weights as
        name = codec.dtype_name(dtype)
        config["dtype"] = name
        if "torch_dtype" in config:
            config["torch_dtype"] = name
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()  # as transformers writes config.json


def consistent(root: str | os.PathLike[str], step: int | None) -> tuple[int, Path, layout.Manifest]:
    """Checkpoint `step` of the store at `root` (None: the latest consistent one): its step, directory and manifest;
    raises when it is not consistent."""
    info = layout.find_checkpoint(root, step)
    if not info.consistent:
        raise CheckpointCorruptError(
            f"checkpoint {info.path} is not consistent: {'; '.join(map(str, info.problems))}", path=info.path
        )
    ckpt = Path(info.path)
    return info.step, ckpt, layout.read_manifest(ckpt)


def check_out(out: Path) -> None:
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{out} is a symbolic link; choose a new directory")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{out} exists and is not a directory; choose a new directory")
    with os.scandir(out) as it:
        if any(True for _ in it):
            raise CheckpointError(f"{out} exists and is not empty; choose a new directory")


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished directory onto `out` (absent or empty: rename replaces an empty directory)."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # mkdtemp made it private; the export is a directory like any other
    layout.fsync_dir(tmp)
    try:
        os.rename(tmp, out)
    except OSError as e:
        raise CheckpointError(
            f"{out}: cannot put the export there ({e.strerror or e}); it must be absent or an empty directory"
        ) from None
    layout.fsync_dir(out.parent)


class _Chunks:
    """An engine checkpoint's tensors, each assembled from its chunks by verified ranged reads.

    A tensor read is valid until the next read: the buffers it is read into and assembled in are reused from
    tensor to tensor (the writer stages each before it asks for the next), so that their pages are faulted in
    once, not once per tensor (that cost as much as the disk's own time here). A tensor whose chunks are whole
    rows of dim 0 (FSDP2's) is returned as those chunks, in order, not assembled (`hfwrite.OutTensor`)."""

    def __init__(self, ckpt: Path, manifest: layout.Manifest, meta: Mapping[str, Any]):
        self.ckpt, self.manifest, self.meta = ckpt, manifest, meta
        self.storage: dict[str, list[Mapping[str, Any]]] = {}
        for s in meta["storage"]:
            self.storage.setdefault(s["fqn"], []).append(s)
        self.files: dict[str, VerifiedFile] = {}
        self._arena: torch.Tensor | None = None  # what the chunks are read into
        self._full: torch.Tensor | None = None  # what a tensor of several chunks is assembled in
        self._read: dict[str, list[tuple[Mapping[str, Any], torch.Tensor]]] = {}  # the last batch's, not yet used
        self.order: dict[str, int] = {}
        self.sequence: list[str] = []

    def _buffer(self, which: str, nbytes: int) -> torch.Tensor:
        """A reused page-aligned buffer of at least `nbytes`, grown (to the largest asked for) when short."""
        buf: torch.Tensor | None = getattr(self, which)
        if buf is None or buf.numel() < nbytes:
            # The arena at once as large as a batch (not grown batch by batch: each new page costs its fault), left
            # for the reading threads to fault in, in parallel, inside their reads.
            floor = BATCH_BYTES if which == "_arena" else 0
            buf = aligned_buffer(max(nbytes, floor), populate=which != "_arena")
            setattr(self, which, buf)
        return buf

    def _file(self, rel: str, crc_rel: str) -> VerifiedFile:
        vf = self.files.get(rel)
        if vf is None:
            vf = VerifiedFile.in_checkpoint(self.ckpt, self.manifest, rel, crc_rel)
            self.files[rel] = vf
        return vf

    def expect(self, fqns: list[str]) -> None:
        """The order the tensors will be read in: each read reads ahead in it (`_batch`)."""
        self.order = {f: i for i, f in enumerate(fqns)}
        self.sequence = list(fqns)

    def _chunks(self, fqn: str) -> list[Mapping[str, Any]]:
        return [s for s in self.storage.get(fqn, []) if s["nbytes"] > 0]

    def _need(self, fqn: str) -> int:
        """The arena bytes `fqn`'s chunks take (read_files lays each widened range out in whole pages)."""
        total = 0
        for c in self._chunks(fqn):
            vf, start = self._file(c["file"], c["crc_file"]), c["byte_offset"]
            total += sum(round_up(e - s, PAGE) for s, e in vf._spans([(start, start + c["nbytes"])]))
        return total

    def _batch(self, fqn: str, alone: bool) -> dict[str, list[tuple[Mapping[str, Any], torch.Tensor]]]:
        """The chunks of `fqn` and, unless `alone`, of the tensors expected after it up to BATCH_BYTES, read in one
        `read_files` (one set of reading threads kept busy, instead of one small read after another)."""
        batch, need = [fqn], self._need(fqn)
        i = self.order.get(fqn)
        if not alone and i is not None:
            for nxt in self.sequence[i + 1 :]:
                n = self._need(nxt)
                if need + n > BATCH_BYTES:
                    break
                batch.append(nxt)
                need += n
        chunks = [(f, c) for f in batch for c in self._chunks(f)]
        requests = [
            (self._file(c["file"], c["crc_file"]), [(c["byte_offset"], c["byte_offset"] + c["nbytes"])])
            for _, c in chunks
        ]
        regions = read_files(requests, arena=self._buffer("_arena", need)) if requests else []
        got: dict[str, list[tuple[Mapping[str, Any], torch.Tensor]]] = {f: [] for f in batch}
        for (f, c), ((base, region),) in zip(chunks, regions, strict=True):
            lo = c["byte_offset"] - base
            got[f].append((c, region[lo : lo + c["nbytes"]]))
        return got

    def read(self, fqn: str) -> torch.Tensor | list[torch.Tensor]:
        t = self.meta["tensors"][fqn]
        dtype, size = codec.dtype_from_name(t["dtype"], fqn), tuple(t["size"])
        if fqn not in self._read:
            try:
                try:
                    self._read = self._batch(fqn, alone=False)
                except CheckpointCorruptError:
                    self._read = {}
                    self._read = self._batch(fqn, alone=True)  # which tensor is bad: fqn, or one read after it
            except CheckpointCorruptError as e:
                raise CheckpointCorruptError(
                    f"{self.ckpt}: {e} (reading {fqn})", path=str(self.ckpt), file=e.file
                ) from None
        views = [(c, raw.view(dtype).reshape(c["sizes"])) for c, raw in self._read.pop(fqn)]
        if not views:
            return torch.empty(size, dtype=dtype)
        slabs = _slabs([(tuple(c["offsets"]), tuple(c["sizes"])) for c, _ in views], size)
        if slabs is not None:  # whole rows of dim 0 (FSDP2's chunks), which tile the tensor: no copy
            return [views[i][1] for i in slabs]
        if len(views) == 1 and tuple(views[0][0]["sizes"]) == size:
            return views[0][1]  # one chunk, the whole tensor: no copy
        nbytes = dtype.itemsize * math.prod(size)
        full = self._buffer("_full", nbytes)[:nbytes].view(dtype).reshape(size)
        for c, chunk in views:
            view = full
            for dim, (o, n) in enumerate(zip(c["offsets"], c["sizes"], strict=True)):
                view = view.narrow(dim, o, n)
            view.copy_(chunk)
        return full


def _slabs(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], size: tuple[int, ...]) -> list[int] | None:
    """The order of `chunks` ((offsets, sizes) in a tensor of `size`) whose elements, one chunk after the other,
    are the tensor's: where each holds whole rows of dim 0 and together they tile it; else None."""
    if not size:
        return None
    order = sorted(range(len(chunks)), key=lambda i: chunks[i][0][0])
    row = 0
    for i in order:
        offsets, sizes = chunks[i]
        if offsets[0] != row or any(offsets[1:]) or tuple(sizes[1:]) != tuple(size[1:]):
            return None
        row += sizes[0]
    return order if row == size[0] else None


def _engine_tensors(
    ckpt: Path, manifest: layout.Manifest, prefix: str | None, dtype: torch.dtype | None, max_shard_bytes: int
) -> list[OutTensor]:
    meta = dcpmeta.read(ckpt, manifest)
    keys = dcpmeta.state_order(meta)  # the model's state dict order: what save_torch_state_dict splits by
    prefix = prefix if prefix is not None else model_prefix(keys)
    names = [k for k in keys if k.startswith(prefix)]
    if not names:
        raise CheckpointError(f"no tensor in {ckpt} starts with {prefix!r}")
    chunks = _Chunks(ckpt, manifest, meta)
    out = []
    for k in names:
        t = meta["tensors"][k]
        saved = codec.dtype_from_name(t["dtype"], k)
        out.append(
            OutTensor(k[len(prefix) :], cast_target(dtype, saved), tuple(t["size"]), functools.partial(chunks.read, k))
        )
    check(out)
    chunks.expect([prefix + t.name for _, group in plan(out, max_shard_bytes) for t in group])
    return out


def _trainer_tensors(
    ckpt: Path, manifest: layout.Manifest, dtype: torch.dtype | None, stack: ExitStack
) -> tuple[list[OutTensor], tuple[dict[str, Any], bytes] | None]:
    """The weights of a Trainer checkpoint, each of their files checked against the manifest first
    (the index whole; each weights file's block checksums, which then verify every range read)."""
    verified: dict[str, VerifiedFile] = {}
    for rel in sorted(n for n in manifest.files if _TRAINER_WEIGHTS.match(n)):
        entry = manifest.files[rel]
        if rel == INDEX_NAME:
            layout.read_verified(ckpt, manifest, rel, hublayout.INDEX_MAX_BYTES)
            continue
        path = layout.resolve_inside(ckpt, rel)
        algorithm = checksums.checksum_algorithm(entry.checksum)
        crcs = checksums.file_block_crcs(path, algorithm)
        if checksums.checksum_from_block_crcs(crcs, algorithm) != entry.checksum:
            raise CheckpointCorruptError(f"{ckpt}/{rel}: checksum mismatch", path=str(ckpt), file=rel)
        verified[rel] = VerifiedFile.of_blocks(str(path), entry.size, crcs, algorithm, rel)
    if not verified:
        raise CheckpointError(f"{ckpt} holds no safetensors weights (saved with save_safetensors=False?)")
    model = hublayout.read(ckpt, follow_links=False)
    for file in model.headers:
        if file not in verified:
            raise CheckpointCorruptError(f"{ckpt}/{file}: not a file of the checkpoint's manifest", path=str(ckpt))
    reader = stack.enter_context(HubReader(model, verified))
    out = []
    for name in model.weight_map:
        saved, shape = reader.spec(name)
        out.append(OutTensor(name, cast_target(dtype, saved), shape, functools.partial(reader.read, name)))
    if CONFIG_NAME not in manifest.files:
        return out, None
    raw = layout.read_verified(ckpt, manifest, CONFIG_NAME, hublayout.CONFIG_MAX_BYTES)
    config = safefile.loads(raw, f"{ckpt}/{CONFIG_NAME}")
    if not isinstance(config, dict):
        raise CheckpointCorruptError(f"{ckpt}/{CONFIG_NAME}: not a JSON object", path=str(ckpt))
    return out, (config, raw)
