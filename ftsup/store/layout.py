"""The checkpoint store on disk: names, manifests, verification, quarantine; stdlib only.

It knows the commit protocol's names and the manifest format, never tensor data (ftsup/store/DESIGN.md, File
format). Which checkpoints to keep is `retention`'s.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftsup.store import blocksum, checksums, nodes, safefile
from ftsup.store.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    ManifestError,
    NoCheckpointError,
)
from ftsup.store.safefile import resolve_inside, validate_relpath
from ftsup.store.writes import fsync_dir as fsync_dir
from ftsup.store.writes import write_file_durable as write_file_durable
from ftsup.store.writes import write_json_atomic as write_json_atomic

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DCP_META_NAME = "dcp_metadata.json"
CHECKSUM_ALGORITHM = blocksum.CURRENT
"""What new checkpoints are written with; `blocksum.ALGORITHMS` lists what verifies."""
CHECKSUM_BLOCK_BYTES = blocksum.BLOCK_BYTES
KINDS = ("periodic", "emergency", "final")

MAX_STEP = 10**18 - 1
"""The largest step a checkpoint may record (18 digits). A directory name with more digits is not
a checkpoint: `int()` of a few thousand digits raises, and no run takes 10**18 steps."""
MAX_WORLD_SIZE = 1 << 24

MANIFEST_MAX_BYTES = 64 << 20
"""The largest manifest read. A rank's three files take about 270 bytes of it, so 64 MiB lists
about 250,000 ranks, more than twice the largest jobs trained today; anything bigger is refused
before it is read (a `/dev/zero` or a sparse terabyte named manifest.json must not exhaust memory)."""
MANIFEST_MAX_VALUES = MANIFEST_MAX_BYTES // 16
"""JSON values a manifest may hold: a real one has one per 20-30 bytes; decoding this many costs
a few hundred MB at most, where 64 MiB of `[0,0,...]` would cost several GB."""
DCP_META_MAX_BYTES = 1 << 30
"""The largest `dcp_metadata.json` read (about 200 bytes per saved chunk: 5 million chunks, e.g.
1,500 tensors sharded over 3,000 ranks). Its exact size is recorded in the manifest as well."""
RANK_STATE_MAX_BYTES = 256 << 20
"""The largest rank state read (RNG streams take a few KiB; small tensors inlined as base64)."""
SIDECAR_MAX_BYTES = 1 << 30
"""The largest `.crc32` sidecar read: 4 bytes per 64 KiB block, so a 16 TiB shard."""

MAX_PROBLEMS = 100
"""A check stops after this many problems: a manifest listing 150,000 files that are not there
is inconsistent after the first, and listing them all costs time and screens."""

_STEP_RE = re.compile(r"^step-(\d{9,18})$")
_PARTIAL_RE = re.compile(r"^step-(\d{9,18})\.partial$")
_SUBSET_RE = re.compile(r"^step-(\d{9,18})\.subset$")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")  # no "/": all validate_relpath asks, "." and ".." apart


# --------------------------------------------------------------------------- names


def step_dirname(step: int) -> str:
    if not 0 <= step <= MAX_STEP:
        raise CheckpointError(f"step must be between 0 and {MAX_STEP}, got {step}")
    return f"step-{step:09d}"


def partial_dirname(step: int) -> str:
    return step_dirname(step) + ".partial"


def parse_step_dirname(name: str) -> int | None:
    """Step of a committed checkpoint directory name, or None for anything else."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_partial_dirname(name: str) -> int | None:
    m = _PARTIAL_RE.match(name)
    return int(m.group(1)) if m else None


def subset_dirname(step: int) -> str:
    """A copy of checkpoint `step` holding only the files its `subset.json` names (`nodes.SUBSET_FILE`): never a
    committed checkpoint, whatever it holds."""
    return step_dirname(step) + ".subset"


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def crc_name(rank: int) -> str:
    """The sidecar with the shard's 64 KiB block checksums (little-endian uint32)."""
    return f"shard-{rank:05d}.crc32"


def rank_state_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds; `files` maps safe relative paths to entries."""

    step: int
    world_size: int
    kind: str
    created_unix: float
    files: Mapping[str, FileEntry]
    tensor_bytes: int
    metadata: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    """What every checksum in `files` is computed with (older checkpoints: ``crc32x64k``)."""
    nodes: Mapping[str, tuple[int, ...]] | None = None
    """Node id -> its ranks, in a store each node keeps for itself (`ftsup.store.nodes`); None: one shared store."""

    def to_json(self) -> dict[str, Any]:
        extra = {"nodes": {n: list(r) for n, r in sorted(self.nodes.items())}} if self.nodes is not None else {}
        return {
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
            "kind": self.kind,
            "created_unix": self.created_unix,
            "checksum_algorithm": self.checksum_algorithm,
            "checksum_block_bytes": CHECKSUM_BLOCK_BYTES,
            "files": {p: {"size": e.size, "checksum": e.checksum} for p, e in sorted(self.files.items())},
            "tensor_bytes": self.tensor_bytes,
            "metadata": dict(self.metadata),
        } | extra


INDENTED_MANIFEST_FILES = 3000
"""A manifest listing more files than this (a job of more than 1,000 ranks) is written as compact JSON: indented
JSON is encoded by the json module's pure-Python encoder, which at 16,384 ranks took most of the commit's time."""


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as written: indented for a person to read, compact where it lists thousands of files."""
    obj = manifest.to_json()
    return (json.dumps(obj, indent=1) if len(manifest.files) <= INDENTED_MANIFEST_FILES else json.dumps(obj)).encode()


def _require(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise ManifestError(f"{where}: key '{key}' is missing")
    value = obj[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ManifestError(f"{where}: key '{key}' must be {types}, got a bool")
    if not isinstance(value, types):
        raise ManifestError(f"{where}: key '{key}' has type {type(value).__name__}, expected {types}")
    return value


def parse_manifest(raw: bytes | str, where: str = "manifest.json") -> Manifest:
    """The manifest in `raw`; raises ManifestError naming what is wrong, or CheckpointFormatError
    (a ManifestError) when it is of a format this ftsup does not read."""
    data = raw.encode() if isinstance(raw, str) else raw
    obj = safefile.loads(data, where, max_values=MANIFEST_MAX_VALUES, error=ManifestError)
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: top level must be an object")
    version = _require(obj, "format_version", int, where)
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{where}: format_version {version} is not supported by this ftsup "
            f"(it reads version {FORMAT_VERSION}); upgrade ftsup to read it"
        )
    # Format 1 manifests have always named their algorithm; one without is read as the first one.
    algo = obj.get("checksum_algorithm", blocksum.CRC32_X64K)
    if not isinstance(algo, str) or algo not in blocksum.ALGORITHMS:
        raise CheckpointFormatError(
            f"{where}: checksum algorithm {algo!r:.40} is not supported by this ftsup "
            f"(it reads {', '.join(blocksum.ALGORITHMS)}); upgrade ftsup to read it"
        )
    block_bytes = obj.get("checksum_block_bytes", CHECKSUM_BLOCK_BYTES)
    if block_bytes != CHECKSUM_BLOCK_BYTES:
        raise CheckpointFormatError(
            f"{where}: checksum_block_bytes {block_bytes!r:.40} is not supported (only {CHECKSUM_BLOCK_BYTES})"
        )
    step = _require(obj, "step", int, where)
    world_size = _require(obj, "world_size", int, where)
    kind = _require(obj, "kind", str, where)
    if kind not in KINDS:
        raise ManifestError(f"{where}: kind {kind!r:.40} is not one of {', '.join(KINDS)}")
    if not 0 <= step <= MAX_STEP or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ManifestError(f"{where}: step must be in [0, {MAX_STEP}] and world_size in [1, {MAX_WORLD_SIZE}]")
    created = _require(obj, "created_unix", (int, float), where)
    if not math.isfinite(created) or abs(created) > 1e11:
        raise ManifestError(f"{where}: created_unix {created!r:.40} is not a time")
    tensor_bytes = _require(obj, "tensor_bytes", int, where)
    if not 0 <= tensor_bytes < 1 << 63:
        raise ManifestError(f"{where}: tensor_bytes must be in [0, 2**63)")
    files_raw = _require(obj, "files", dict, where)
    if not files_raw:
        raise ManifestError(f"{where}: lists no files (every checkpoint has some)")
    files: dict[str, FileEntry] = {}
    checksum_re = re.compile(re.escape(algo) + r":[0-9a-f]{8}")
    plain = _PLAIN_NAME.fullmatch
    for rel, entry in files_raw.items():
        # 50,000 entries at 16k ranks: plain names, well-typed entries go the short way; the rest, the full checks.
        if not (plain(rel) and rel not in (".", "..")):
            validate_relpath(rel)
        if rel == MANIFEST_NAME:
            raise ManifestError(f"{where}: the manifest must not list itself")
        if type(entry) is not dict or type(entry.get("size")) is not int or type(entry.get("checksum")) is not str:
            at = f"{where}: files[{rel!r}]"
            if not isinstance(entry, dict):
                raise ManifestError(f"{at} must be an object")
            _require(entry, "size", int, at), _require(entry, "checksum", str, at)
        size, checksum = entry["size"], entry["checksum"]
        if not 0 <= size < 1 << 63:
            raise ManifestError(f"{where}: files[{rel!r}] has a size outside [0, 2**63)")
        if not checksum_re.fullmatch(checksum):
            raise ManifestError(f"{where}: files[{rel!r}] checksum {checksum!r} is not '{algo}:<8 hex digits>'")
        files[rel] = FileEntry(size=size, checksum=checksum)
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ManifestError(f"{where}: metadata must be an object")
    if "step" in metadata and (type(metadata["step"]) is not int or metadata["step"] != step):
        # The trainer's metadata records the step it saved: a checkpoint copied under another
        # step (its manifest edited to match the new name) must not become the newest one.
        raise ManifestError(f"{where}: records step {step} but its metadata says step {metadata['step']!r:.40}")
    nodes_raw = obj.get("nodes")
    return Manifest(
        nodes=None if nodes_raw is None else nodes.parse_nodes(nodes_raw, world_size, where),
        step=step,
        world_size=world_size,
        kind=kind,
        created_unix=float(created),
        files=files,
        tensor_bytes=tensor_bytes,
        metadata=metadata,
        format_version=version,
        checksum_algorithm=algo,
    )


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    """The manifest of `ckpt_dir`: a regular file (never through a symlink, never a FIFO or a
    device) of at most MANIFEST_MAX_BYTES."""
    path = Path(ckpt_dir) / MANIFEST_NAME
    try:
        os.lstat(path)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (the checkpoint was never committed)") from None
    except OSError:
        pass  # e.g. an unreadable directory: the open below says so
    raw = safefile.read_regular(path, str(path), MANIFEST_MAX_BYTES, error=ManifestError)
    manifest = parse_manifest(raw, str(path))
    expected = parse_step_dirname(Path(ckpt_dir).name)
    if expected is not None and expected != manifest.step:
        raise ManifestError(f"{path}: records step {manifest.step} but lives in {Path(ckpt_dir).name}")
    return manifest


def read_verified(ckpt_dir: str | os.PathLike[str], manifest: Manifest, rel: str, max_bytes: int) -> bytes:
    """A small file of a committed checkpoint, whole, after checking it against the manifest: a
    regular file inside the checkpoint, of the recorded size (at most `max_bytes`) and checksum."""
    entry = manifest.files.get(rel)
    if entry is None:
        raise CheckpointCorruptError(f"{ckpt_dir}/{rel}: missing from the manifest", path=str(ckpt_dir), file=rel)
    what = f"{ckpt_dir}/{rel}"
    try:
        raw = safefile.read_regular(resolve_inside(ckpt_dir, rel), what, max_bytes, exact=entry.size)
    except CheckpointError as e:
        raise CheckpointCorruptError(str(e), path=str(ckpt_dir), file=rel) from None
    if not checksums.checksum_matches(raw, entry.checksum):
        raise CheckpointCorruptError(f"{ckpt_dir}/{rel}: checksum mismatch", path=str(ckpt_dir), file=rel)
    return raw


# --------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class Problem:
    """Why a checkpoint is not consistent; `file` is None for manifest-level problems."""

    file: str | None
    reason: str
    unknown_format: bool = False
    """The manifest is of a format this ftsup does not read (see CheckpointFormatError)."""

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}" if self.file else self.reason


def check_checkpoint(ckpt_dir: str | os.PathLike[str], *, deep: bool = False) -> tuple[Manifest | None, list[Problem]]:
    """(manifest, problems): fast = manifest parses and sizes match; deep adds checksums."""
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointFormatError as e:
        return None, [Problem(MANIFEST_NAME, str(e), unknown_format=True)]
    except ManifestError as e:
        return None, [Problem(MANIFEST_NAME, str(e))]
    base = os.fspath(ckpt_dir)
    try:  # a node-local store's copy holds its node's files only (`ftsup.store.nodes`)
        subset = _SUBSET_RE.match(Path(base).name) is not None
        held = nodes.held_files(base, manifest.files, manifest.nodes, subset=subset)
    except ManifestError as e:
        return None, [Problem(nodes.SUBSET_FILE if subset else nodes.NODE_FILE, str(e))]
    dir_fd = safefile.open_dir(base)  # names looked up in it: a path walked from / for 50,000 files costs more
    try:
        return manifest, _check_files(base, dir_fd, manifest, held, deep)
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


def _check_files(
    base: str, dir_fd: int | None, manifest: Manifest, held: Mapping[str, FileEntry], deep: bool
) -> list[Problem]:
    problems: list[Problem] = []
    lstat = functools.partial(os.lstat, dir_fd=dir_fd) if dir_fd is not None else lambda r: os.lstat(f"{base}/{r}")
    for rel, entry in sorted(held.items()):
        if len(problems) >= MAX_PROBLEMS:
            problems.append(Problem(None, f"more than {MAX_PROBLEMS} problems; the rest were not checked"))
            break
        try:
            flat = lstat(rel) if "/" not in rel else None  # no directory on the way, no link
            if flat is not None and stat.S_ISREG(flat.st_mode):
                path, st = Path(base, rel) if deep else None, flat
            else:  # nested, or a link: resolved, and refused if it leaves the checkpoint
                path = resolve_inside(base, rel)
                st = os.stat(path)  # `path` is resolved: no link is left in it
        except ManifestError as e:
            problems.append(Problem(rel, str(e)))
            continue
        except FileNotFoundError:
            problems.append(Problem(rel, "missing"))
            continue
        except OSError as e:
            problems.append(Problem(rel, f"cannot stat ({e.strerror or e})"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(Problem(rel, "not a regular file"))
            continue
        if st.st_size != entry.size:
            problems.append(Problem(rel, f"size {st.st_size} != recorded {entry.size}"))
            continue
        if deep:
            assert path is not None
            try:
                actual = checksums.file_checksum(path, manifest.checksum_algorithm)
            except CheckpointError as e:
                problems.append(Problem(rel, str(e)))
                continue
            if actual != entry.checksum:
                problems.append(Problem(rel, f"checksum {actual} != recorded {entry.checksum}"))
    return problems


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    consistent: bool
    kind: str | None = None
    world_size: int | None = None
    created_unix: float | None = None
    problems: tuple[Problem, ...] = ()
    tensor_bytes: int | None = None
    metadata: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)  # as checked: not re-read

    @property
    def unknown_format(self) -> bool:
        """Written by a newer ftsup: skipped, never quarantined or deleted."""
        return any(p.unknown_format for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "consistent": self.consistent,
            "path": self.path,
            "problems": [str(p) for p in self.problems],
            "unknown_format": self.unknown_format,
        }


def inspect_checkpoint(ckpt_dir: str | os.PathLike[str], *, deep: bool = False) -> CheckpointInfo:
    ckpt_dir = Path(ckpt_dir)
    step = parse_step_dirname(ckpt_dir.name)
    manifest, problems = check_checkpoint(ckpt_dir, deep=deep)
    return CheckpointInfo(
        step=manifest.step if manifest else (step if step is not None else -1),
        path=str(ckpt_dir),
        consistent=manifest is not None and not problems,
        kind=manifest.kind if manifest else None,
        world_size=manifest.world_size if manifest else None,
        created_unix=manifest.created_unix if manifest else None,
        problems=tuple(problems),
        tensor_bytes=manifest.tensor_bytes if manifest else None,
        metadata=manifest.metadata if manifest else None,
    )


def committed_dirs(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of every committed-looking directory, oldest first."""
    root = Path(root)
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        step = parse_step_dirname(e.name)
        if step is not None and e.is_dir(follow_symlinks=False):
            out.append((step, Path(e.path)))
    return sorted(out)


def list_checkpoints(root: str | os.PathLike[str], *, deep: bool = False) -> list[CheckpointInfo]:
    """Every committed checkpoint under `root`, oldest first, each checked (fast or deep)."""
    return [inspect_checkpoint(p, deep=deep) for _, p in committed_dirs(root)]


def latest_consistent(
    root: str | os.PathLike[str], *, deep: bool = False, below: int | None = None
) -> CheckpointInfo | None:
    """The highest step whose manifest parses and whose files check out (optionally < `below`)."""
    for step, path in reversed(committed_dirs(root)):
        if below is not None and step >= below:
            continue
        info = inspect_checkpoint(path, deep=deep)
        if info.consistent:
            return info
    return None


def find_checkpoint(root: str | os.PathLike[str], step: int | None, *, deep: bool = False) -> CheckpointInfo:
    """The checkpoint for `step` (or the latest consistent one); raises when there is none."""
    if step is None:
        info = latest_consistent(root, deep=deep)
        if info is None:
            raise NoCheckpointError(f"no consistent checkpoint under {root}")
        return info
    # Only what committed_dirs lists: a symlink named step-N (to a checkpoint elsewhere) is not one.
    found = [p for s, p in committed_dirs(root) if s == step]
    if not found:
        raise NoCheckpointError(f"no committed checkpoint for step {step} under {root}")
    canonical = [p for p in found if p.name == step_dirname(step)]
    return inspect_checkpoint((canonical or found)[0], deep=deep)


def quarantine(ckpt_dir: str | os.PathLike[str]) -> Path:
    """Rename the checkpoint directory `ckpt_dir` (as found: its name is never recomputed from its
    step) to `<name>.corrupt`, never deleting evidence, and return the new path. Raises OSError
    when it cannot be renamed (e.g. another user's directory in a sticky store)."""
    src = Path(ckpt_dir)
    dst = src.with_name(src.name + ".corrupt")
    n = 1
    while os.path.lexists(dst):  # a dangling link there is something too
        dst = src.with_name(f"{src.name}.corrupt.{n}")
        n += 1
    os.rename(src, dst)
    fsync_dir(src.parent)
    return dst
