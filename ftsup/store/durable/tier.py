"""The durable tier's contract: locations, options, the backend interface `DurableTier`, and what both backends
share (the local checkpoint read for upload, the data token, part plans, streamed checks, the download).

Stdlib only; everything read from a tier is hostile (ftsup/store/DESIGN.md, Durable tier).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import math
import os
import re
import secrets
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from ftsup.store import checksums, layout, retention, safefile
from ftsup.store.errors import CheckpointCorruptError, CheckpointError, DurableTierError, ManifestError

MIB = 1 << 20
MAX_PARTS = 10_000
"""The most parts an S3 multipart upload may have; a file too large for `part_bytes` parts gets larger parts."""
MIN_PART_BYTES = 5 * MIB
"""S3's smallest part (but the last)."""
READ_CHUNK_BYTES = 16 * MIB
"""Ranged reads of a download or a deep check, a multiple of the checksum block."""
READ_PIECE_BYTES = 1 * MIB
"""What `read_pieces` hands over at a time: a multiple of the checksum block, small enough that the reader checksums
(and writes) each piece while the CPU's cache still holds it, and that a 16 MiB answer needs no 16 MiB allocation."""
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_PART = re.compile(r"^[A-Za-z0-9!_.*'()=+,;:@ -]{1,200}$")
_TOKEN = re.compile(r"^data-[0-9a-f]{24}$")

PartHook = Callable[[str, int], None]
"""Called with (file, part number) after each part a backend sent (observability, and a test's fault point)."""
PieceHook = Callable[[int, bytes], None]
"""Called by `DurableTier.read_pieces` with (offset in the file, bytes) of each piece read, in file order."""
PauseHook = Callable[[float], None]
"""Called by an upload before it reads each part and between the pieces of each part it sends, with the longest it
may wait there: `math.inf` before a part (the hook's own bound applies), BODY_PAUSE_S inside a request. It returns
when the upload may go on, and may first block for a while (the supervisor's `save_hold`: while a save is in progress
in the node's fast tier, so that the upload's disk, CPU and store traffic stay off the training's save)."""
BODY_PAUSE_S = 5.0
"""The longest an upload pauses inside one request's body: a store drops a request whose body stalls for long (S3
does; ftsup/store/DESIGN.md, Durable tier), and the part would be sent again."""
MAX_TIMEOUT_S = 7 * 86400.0


@dataclass(frozen=True)
class Location:
    """Where a durable tier is: `s3://bucket/prefix` (`bucket`, `prefix`) or a filesystem `path`."""

    url: str
    bucket: str | None = None
    prefix: str = ""
    path: Path | None = None

    @property
    def is_s3(self) -> bool:
        return self.bucket is not None


def parse_location(url: str) -> Location:
    """The location `url` names; raises CheckpointError naming what is wrong with it."""
    if not isinstance(url, str) or not url or "\x00" in url:
        raise CheckpointError(f"durable tier {url!r:.80}: not a location (s3://BUCKET/PREFIX or a path)")
    if "://" not in url:
        path = Path(url)
        if not path.is_absolute():
            raise CheckpointError(f"durable tier {url!r:.200}: a filesystem path must be absolute")
        return Location(url=str(path), path=path)
    scheme, _, rest = url.partition("://")
    if scheme != "s3":
        raise CheckpointError(f"durable tier {url!r:.200}: scheme {scheme!r:.20} is not s3 (s3://BUCKET/PREFIX)")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise CheckpointError(
            f"durable tier {url!r:.200}: bucket {bucket!r:.80} is not an S3 bucket name (3-63 of a-z, 0-9, '.', '-')"
        )
    prefix = prefix.rstrip("/")
    parts = prefix.split("/") if prefix else []
    for part in parts:
        if part in (".", "..") or not _PREFIX_PART.match(part):
            raise CheckpointError(
                f"durable tier {url!r:.200}: prefix component {part!r:.80} is empty, '.', '..' or holds a character "
                "other than letters, digits, space and !_.*'()=+,;:@-"
            )
    canonical = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return Location(url=canonical, bucket=bucket, prefix=prefix)


@dataclass(frozen=True)
class DurableOptions:
    """How a backend talks to its tier. Credentials are never here: an S3 tier takes them from the standard AWS
    environment variables and files (`ftsup/store/DESIGN.md`, "Durable tier")."""

    endpoint_url: str | None = None
    """The S3 endpoint (`http://host:port`); None takes the standard `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`,
    else AWS's own."""
    region: str | None = None
    """The S3 region; None takes the standard AWS configuration (and us-east-1 without one)."""
    part_bytes: int = 16 * MIB
    """The size of an upload's parts (a multiple of the 64 KiB checksum block, at least 5 MiB); a file of at most
    this many bytes goes in one request."""
    concurrency: int = 8
    """Parts (or files) in flight at once."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    """The longest a request waits for the next byte of its answer (or to send the next piece of its body)."""
    request_timeout_s: float = 120.0
    """The longest one request may take in all, from its connection to its answer's last byte: a store that answers
    a byte at a time fails the request then (retried as a timeout is, up to `max_attempts`)."""
    operation_timeout_s: float = 600.0
    """The longest one read of the tier may take as a whole (a listing with the checks of what it lists, a check, a
    delete, a download: `DurableTier.deadline`); a caller may give a shorter one (the resume choice, a rank's read
    of one checkpoint)."""
    max_attempts: int = 3
    """Attempts of each request before the operation fails with DurableTierError (and resumes when called again)."""

    def __post_init__(self) -> None:
        block = layout.CHECKSUM_BLOCK_BYTES
        if self.part_bytes < MIN_PART_BYTES or self.part_bytes % block:
            raise CheckpointError(f"part_bytes {self.part_bytes} must be a multiple of {block} and at least 5 MiB")
        if not 1 <= self.concurrency <= 256:
            raise CheckpointError(f"concurrency {self.concurrency} must be in [1, 256]")
        if not 1 <= self.max_attempts <= 20:
            raise CheckpointError(f"max_attempts {self.max_attempts} must be in [1, 20]")
        if not (0 < self.connect_timeout_s <= 600 and 0 < self.read_timeout_s <= 3600):
            raise CheckpointError("connect_timeout_s must be in (0, 600] and read_timeout_s in (0, 3600]")
        if not (0 < self.request_timeout_s <= MAX_TIMEOUT_S and 0 < self.operation_timeout_s <= MAX_TIMEOUT_S):
            raise CheckpointError(f"request_timeout_s and operation_timeout_s must be in (0, {MAX_TIMEOUT_S:g}]")


@dataclass(frozen=True)
class LocalCheckpoint:
    """A committed checkpoint of the fast tier, as an upload reads it: its manifest, parsed and as bytes."""

    path: Path
    manifest: layout.Manifest
    manifest_raw: bytes

    @property
    def token(self) -> str:
        return data_token(self.manifest_raw)


def read_local(ckpt_dir: str | os.PathLike[str]) -> LocalCheckpoint:
    """The committed checkpoint `ckpt_dir` (a `step-N` directory), fast-checked; raises CheckpointError (a
    ManifestError or CheckpointCorruptError) naming what is wrong. Its bytes are checked as they are uploaded."""
    path = Path(ckpt_dir)
    if layout.parse_step_dirname(path.name) is None:
        raise CheckpointError(f"{path}: not a committed checkpoint directory (step-NNNNNNNNN)")
    manifest, problems = layout.check_checkpoint(path)
    if manifest is None or problems:
        raise CheckpointCorruptError(f"{path}: not consistent: {'; '.join(map(str, problems))}", path=str(path))
    where = str(path / layout.MANIFEST_NAME)
    raw = safefile.read_regular(path / layout.MANIFEST_NAME, where, layout.MANIFEST_MAX_BYTES, error=ManifestError)
    if layout.parse_manifest(raw, where) != manifest:
        raise ManifestError(f"{where}: changed while it was read")
    return LocalCheckpoint(path=path, manifest=manifest, manifest_raw=raw)


def data_token(manifest_raw: bytes) -> str:
    """The name of the folder that holds a checkpoint's files in a tier: `data-` and 96 bits of the manifest's
    SHA-256. Every file's key follows from the manifest that commits it, so a writer of other content for the same
    step never writes where a committed manifest's files are, and writers of the same content share one upload."""
    return "data-" + hashlib.sha256(manifest_raw).hexdigest()[:24]


def is_token(name: str) -> bool:
    return bool(_TOKEN.match(name))


def part_size(size: int, part_bytes: int) -> int:
    """The part size of a file of `size` bytes: `part_bytes`, or more where that would take over MAX_PARTS parts."""
    block = layout.CHECKSUM_BLOCK_BYTES
    need = -(-size // MAX_PARTS)
    return max(part_bytes, -(-need // block) * block)


def part_plan(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each part of a file of `size` bytes (one part, maybe empty, up to `part_bytes`)."""
    if size <= part_bytes:
        return [(0, size)]
    step = part_size(size, part_bytes)
    return [(off, min(step, size - off)) for off in range(0, size, step)]


def composite_etag(md5s: list[bytes]) -> str:
    """The ETag S3 gives an object completed from parts with these MD5 digests (`<md5 of the md5s>-<parts>`)."""
    return f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"


def blocks_problem(entry: layout.FileEntry, crcs: list[int], algorithm: str) -> str | None:
    """Why the block checksums `crcs` of a whole file do not give its recorded checksum, or None when they do."""
    actual = checksums.checksum_from_block_crcs(crcs, algorithm)
    return None if actual == entry.checksum else f"checksum {actual} != recorded {entry.checksum}"


def check_blocks(where: str, rel: str, entry: layout.FileEntry, crcs: list[int], algorithm: str) -> None:
    """Raise CheckpointCorruptError unless the block checksums `crcs` of a whole file give its recorded checksum."""
    why = blocks_problem(entry, crcs, algorithm)
    if why is not None:
        raise CheckpointCorruptError(f"{where}/{rel}: {why}", path=where, file=rel)


def clean_name(name: str, limit: int = 120) -> str:
    """A name read from a tier as it may be shown: escaped (no control characters reach a terminal), cut short."""
    shown = ascii(name)[1:-1]
    return shown if len(shown) <= limit else shown[:limit] + "..."


@dataclass(frozen=True)
class UploadReport:
    """What one upload did: `outcome` is "committed" (this call committed the step) or "already" (the step was
    committed with this same content, by this writer before or by another)."""

    step: int
    url: str
    outcome: str
    files: int
    bytes_total: int
    bytes_sent: int = 0
    parts_sent: int = 0
    parts_kept: int = 0
    """Parts (and whole files) already in the tier that verified and were not sent again."""


@dataclass(frozen=True)
class DurableListing:
    """A tier's committed checkpoints, oldest first, and the names under it that are not one (uploads not
    committed, names ftsup never writes), escaped for display."""

    checkpoints: list[layout.CheckpointInfo]
    others: list[str] = field(default_factory=list)


class DurableTier(ABC):
    """One durable tier. The backends implement the primitives; download is the same for both."""

    location: Location
    options: DurableOptions
    ends_at: float | None = None
    """When the operation in progress must end (`time.monotonic()`), set by `deadline`; None: none."""
    budget_s: float = math.inf
    """How long that operation was given (for its error)."""

    @property
    def url(self) -> str:
        return self.location.url

    @contextlib.contextmanager
    def deadline(self, seconds: float | None = None) -> Iterator[None]:
        """Every request of the tier made inside the block, on any thread, ends within `seconds` from now
        (None: `options.operation_timeout_s`; a deadline already set that comes earlier stands). Past it a request
        fails, and so the operation, with DurableTierError naming the deadline."""
        seconds = self.options.operation_timeout_s if seconds is None else seconds
        before = (self.ends_at, self.budget_s)
        ends = time.monotonic() + seconds
        if self.ends_at is None or ends < self.ends_at:
            self.ends_at, self.budget_s = ends, seconds
        try:
            yield
        finally:
            self.ends_at, self.budget_s = before

    def check_deadline(self, what: str) -> None:
        """Raise DurableTierError when the operation's deadline has passed (a backend that reads in steps)."""
        if self.ends_at is not None and time.monotonic() >= self.ends_at:
            raise DurableTierError(f"{what}: not done by its operation's deadline ({self.budget_s:g}s)")

    def step_url(self, step: int) -> str:
        return f"{self.url.rstrip('/')}/{layout.step_dirname(step)}"

    @abstractmethod
    def upload(
        self,
        ckpt_dir: str | os.PathLike[str],
        *,
        on_part: PartHook | None = None,
        node: str | None = None,
        pause: PauseHook | None = None,
    ) -> UploadReport:
        """Copy the committed local checkpoint `ckpt_dir` into the tier and commit it there; with `node`, only the
        part of a checkpoint that node holds, committed once every node's part is there (`ftsup.store.nodes`). Raises
        DurableTierError when the tier fails (call again: what arrived and verifies is kept),
        DurableConflictError when the step is committed there with other content, CheckpointCorruptError when
        the local copy does not match its manifest."""

    def follows(self, ckpt_dir: str | os.PathLike[str], node: str, picked: bool) -> str:
        """Whether node `node` uploads its part of the checkpoint `ckpt_dir` now: "go", "skip" (not picked), or,
        where the tier keeps node parts (`s3nodes.follows`), "follow" (the node of rank 0 picked it);
        DurableWaitError while a periodic one waits for that node's pick. Here: what this node picked goes."""
        return "go" if picked else "skip"

    def sweep(self, step: int, nodes: set[str]) -> int:
        """Delete what the nodes `nodes` wrote for `step`, which was never committed (`s3nodes.sweep`);
        the number of objects deleted. Here (no node parts): nothing."""
        return 0

    @abstractmethod
    def list_checkpoints(self, *, deep: bool = False) -> DurableListing:
        """The committed checkpoints, each checked (fast or deep); a step without a manifest is not one."""

    def committed_steps(self) -> list[int]:
        """The steps that look committed (`step-N` names), oldest first, none of them checked: what a choice looks
        at newest first, checking one at a time (`ftsup.store.tiers`)."""
        return [c.step for c in self.list_checkpoints().checkpoints]

    @abstractmethod
    def inspect(self, step: int, *, deep: bool = False) -> layout.CheckpointInfo:
        """The check of the committed checkpoint of `step`; NoCheckpointError when its manifest is not there."""

    @abstractmethod
    def manifest(self, step: int) -> tuple[layout.Manifest, bytes]:
        """The committed manifest of `step`, parsed and as stored; NoCheckpointError when there is none."""

    @abstractmethod
    def read_range(self, step: int, token: str, rel: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of file `rel` of the checkpoint whose data is `token`, exactly."""

    def read_pieces(self, step: int, token: str, rel: str, offset: int, length: int, each: PieceHook) -> None:
        """`read_range` handed over piece by piece as it arrives: `each(file_offset, data)` in file order, every
        piece READ_PIECE_BYTES but the last. A backend that streams overrides this; here, the range as one piece."""
        each(offset, self.read_range(step, token, rel, offset, length))

    @abstractmethod
    def delete(self, step: int) -> int:
        """Delete the committed checkpoint of `step` (its manifest first, then only the files it names); the
        number of objects or files removed. NoCheckpointError when there is none."""

    def close(self) -> None:  # noqa: B027 - a backend with nothing to release needs no override
        """Release what the backend holds (connections)."""

    def __enter__(self) -> DurableTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def download(self, step: int, dest_root: str | os.PathLike[str]) -> Path:
        """Copy the committed checkpoint of `step` into the local store `dest_root` as `step-N/`, every byte checked
        against the manifest as it arrives, then committed by the local protocol (files, manifest last, rename);
        returns its path. Raises CheckpointCorruptError naming the file when the tier's copy does not verify (nothing
        is committed locally then), CheckpointError when `dest_root` already holds that step."""
        with self.deadline():
            return self._download(step, dest_root)

    def _download(self, step: int, dest_root: str | os.PathLike[str]) -> Path:
        manifest, raw = self.manifest(step)
        dest_root = Path(dest_root)
        final = dest_root / layout.step_dirname(step)
        if os.path.lexists(final):
            raise CheckpointError(f"{final}: already there; a download never replaces a checkpoint")
        dest_root.mkdir(parents=True, exist_ok=True)
        work = dest_root / f".{layout.step_dirname(step)}.download-{secrets.token_hex(4)}"
        os.mkdir(work, 0o755)
        try:
            self._fetch_into(step, manifest, raw, work)
            try:
                os.rename(work, final)  # fails onto a non-empty directory: a step saved meanwhile is kept
            except OSError as e:
                raise CheckpointError(f"{final}: could not commit the download ({e.strerror or e})") from e
        except BaseException:
            _remove_own(dest_root, work.name)  # a random name of ours: nothing else is in it
            raise
        layout.fsync_dir(dest_root)
        return final

    def _fetch_into(self, step: int, manifest: layout.Manifest, raw: bytes, work: Path) -> None:
        """Every file of the checkpoint into `work`, checked, fsynced; the manifest last."""
        for rel in sorted(manifest.files):
            safefile.resolve_inside(work, rel)
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(work / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))

        def write(rel: str, offset: int, data: bytes) -> None:
            fd = os.open(work / rel, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                view, at = memoryview(data), offset
                while view:
                    n = os.pwrite(fd, view, at)
                    view, at = view[n:], at + n
            finally:
                os.close(fd)

        problems = self.read_files(step, data_token(raw), manifest, write)
        if problems:
            rel, why = problems[0].file or "", problems[0].reason
            raise CheckpointCorruptError(f"{self.step_url(step)}/{rel}: {why}", path=self.step_url(step), file=rel)
        for rel in sorted(manifest.files):
            fd = os.open(work / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        layout.write_file_durable(work / layout.MANIFEST_NAME, raw)
        layout.fsync_dir(work)

    def read_files(
        self, step: int, token: str, manifest: layout.Manifest, write: Callable[[str, int, bytes], None] | None = None
    ) -> list[layout.Problem]:
        """Read every file of the checkpoint back in READ_CHUNK_BYTES ranges, `options.concurrency` at once, each
        range checksummed and handed to `write(rel, offset, data)` (when given) piece by piece as it arrives
        (`read_pieces`); the files that do not give their recorded checksum."""
        algorithm = manifest.checksum_algorithm
        crcs: dict[tuple[str, int], array[int]] = {}
        broken: dict[str, str] = {}

        def chunks() -> Iterator[tuple[str, int, int]]:  # planned as read: a size a manifest claims allocates nothing
            for rel, entry in sorted(manifest.files.items()):
                for off in range(0, entry.size, READ_CHUNK_BYTES):
                    if rel in broken:
                        break
                    yield rel, off, min(READ_CHUNK_BYTES, entry.size - off)

        def one(rel: str, offset: int, length: int) -> None:
            if rel in broken:
                return
            blocks: list[int] = []

            def piece(at: int, data: bytes) -> None:  # checksummed and written while the cache holds it
                checksums.block_crcs(data, blocks, algorithm)
                if write is not None:
                    write(rel, at, data)

            try:
                self.read_pieces(step, token, rel, offset, length, piece)
            except CheckpointCorruptError as e:
                broken.setdefault(rel, str(e).rpartition(f"/{rel}: ")[2] or str(e))
                return
            crcs[(rel, offset)] = array("I", blocks)

        run_all((functools.partial(one, *chunk) for chunk in chunks()), self.options.concurrency, "ftsup-durable-read")
        problems = []
        for rel, entry in sorted(manifest.files.items()):
            why = broken.get(rel)
            if why is None:
                blocks = [c for off in range(0, entry.size, READ_CHUNK_BYTES) for c in crcs[(rel, off)]]
                why = blocks_problem(entry, blocks, algorithm)
            if why is not None:
                problems.append(layout.Problem(rel, why))
            if len(problems) >= layout.MAX_PROBLEMS:
                break
        return problems


def run_all(jobs: Iterable[Callable[[], object]], threads: int, name: str) -> None:
    """Run `jobs` on `threads` threads (named `name`), taking them from `jobs` as threads come free (at most twice
    `threads` waiting); at the first that raises, no more are started and its exception is raised once the running
    ones end."""
    jobs = iter(jobs)
    with ThreadPoolExecutor(threads, thread_name_prefix=name) as pool:
        running = {pool.submit(job) for job in itertools.islice(jobs, 2 * threads)}
        while running:
            done, running = wait(running, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                for f in running:
                    f.cancel()
                wait(running)
                raise failed[0].exception()  # type: ignore[misc]
            running |= {pool.submit(job) for job in itertools.islice(jobs, len(done))}


def _remove_own(parent: Path, name: str) -> None:
    """Remove the directory `name` this process made under `parent` (never through a link)."""
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        retention.remove_dir(fd, name)
    finally:
        os.close(fd)
