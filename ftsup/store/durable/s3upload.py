"""The upload of a committed local checkpoint into a durable tier on object storage: verified, resumable multipart
uploads, then the conditional commit (ftsup/store/DESIGN.md, Durable tier).

The requests are the tier's (`S3Tier.call`, `head`, `put`, `parts_of`); this module makes none of its own.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftsup.store import checksums, layout, safefile
from ftsup.store.durable import s3list
from ftsup.store.durable import tier as durable
from ftsup.store.errors import CheckpointCorruptError, CheckpointError, DurableConflictError, DurableTierError

if TYPE_CHECKING:
    from ftsup.store.durable.s3 import S3Tier


PIECE_BYTES = 256 << 10
"""What an upload reads, hashes and sends of a part between two calls of its pause hook (a multiple of the checksum
block): a hold that begins mid-part stops each thread within a piece (a quarter of a millisecond of MD5 here)."""

PASSES = 3
"""Times a file is sent in one upload before its object is left to the next one (`_check_objects` then refuses the
commit): an object there with other bytes, a multipart upload the store dropped meanwhile."""


class PreconditionFailed(Exception):
    """The store refused a conditional write: the object is there."""


class BodyTorn(DurableTierError):
    """The store says a request's body did not arrive whole (`SHORT_BODY_CODES`, or its Content-MD5 refused): a part,
    or a file sent whole, is sent again, `BODY_RESENDS` times at most, before its upload fails."""


SHORT_BODY_CODES = frozenset({"IncompleteBody", "RequestTimeout", "ClientDisconnected"})
"""S3's answers for a body that came short or stalled (SeaweedFS's ClientDisconnected among them); botocore retries
RequestTimeout by itself, the others not."""
BODY_RESENDS = 2


class UploadGone(DurableTierError):
    """A multipart upload the store no longer knows (completed by another writer of the same bytes, aborted by a
    lifecycle rule or another client): its file is looked up again, and sent again in a new one unless it is there."""


@dataclass
class FilePlan:
    """One file of an upload: where it goes, its parts, what the tier already holds of it, what was read and sent."""

    rel: str
    entry: layout.FileEntry
    key: str
    parts: list[tuple[int, int]]
    done_etag: str | None = None  # the object is there at this size: kept if its ETag is the parts' one
    mismatched: bool = False  # it was there, but not with this upload's bytes: written again, never just checked
    upload_id: str | None = None
    have: dict[int, tuple[str, int]] = field(default_factory=dict)  # part number -> (ETag, size) already sent
    md5s: dict[int, bytes] = field(default_factory=dict)
    crcs: dict[int, list[int]] = field(default_factory=dict)
    etags: dict[int, str] = field(default_factory=dict)

    @property
    def single(self) -> bool:
        return len(self.parts) == 1


def read_local(ckpt_dir: str | os.PathLike[str]) -> durable.LocalCheckpoint:
    """`durable.read_local`, refusing a manifest bigger than a tier on object storage holds."""
    local = durable.read_local(ckpt_dir)
    if len(local.manifest_raw) > s3list.MANIFEST_MAX_BYTES:
        raise CheckpointError(
            f"{local.path}: its manifest is {len(local.manifest_raw)} bytes, over the {s3list.MANIFEST_MAX_BYTES} "
            "bytes a durable tier on object storage holds (about 32,000 ranks); nothing was sent"
        )
    return local


def upload(
    tier: S3Tier,
    ckpt_dir: str | os.PathLike[str],
    *,
    on_part: durable.PartHook | None = None,
    pause: durable.PauseHook | None = None,
) -> durable.UploadReport:
    """`S3Tier.upload`: copy the committed local checkpoint `ckpt_dir` into `tier` and commit it there."""
    local = read_local(ckpt_dir)
    step = local.manifest.step
    report = {"bytes_sent": 0, "parts_sent": 0, "parts_kept": 0}
    total = sum(e.size for e in local.manifest.files.values())
    done = durable.UploadReport(step, tier.step_url(step), "already", len(local.manifest.files), total)
    existing = tier.manifest_raw(step)
    if existing is not None:
        return same_or_conflict(tier, step, existing, local.manifest_raw, done)
    token = local.token
    plans = [
        FilePlan(rel, e, tier.data_key(step, token, rel), durable.part_plan(e.size, tier.options.part_bytes))
        for rel, e in sorted(local.manifest.files.items())
    ]
    unfinished = s3list.uploads_under(tier, tier.key(layout.step_dirname(step), token) + "/")
    with ThreadPoolExecutor(tier.options.concurrency, thread_name_prefix="ftsup-s3") as pool:
        wait_all([pool.submit(plan_file, tier, p, unfinished.get(p.key, [])) for p in plans])
        retry = send_plans(tier, pool, local, plans, report, on_part, pause)
        for _ in range(PASSES - 1):
            if not retry:
                break
            # Objects there but not as this upload writes them, uploads gone: sent again, in new uploads.
            for p in retry:
                p.done_etag, p.upload_id, p.md5s, p.crcs, p.etags, p.have = None, None, {}, {}, {}, {}
                # An upload gone may have been completed by another writer of these bytes: looked up again.
                plan_file(tier, p, [], fresh=p.mismatched)
            retry = send_plans(tier, pool, local, retry, report, on_part, pause)
    _check_objects(tier, step, token, local.manifest)
    try:
        tier.put(tier.manifest_key(step), local.manifest_raw, if_none_match=True)
    except PreconditionFailed:
        raw = tier.manifest_raw(step)
        if raw != local.manifest_raw:  # our files sit under our manifest's hash, which nothing committed names
            with contextlib.suppress(CheckpointError):
                s3list.delete_files(tier, step, token, sorted(local.manifest.files))
        return same_or_conflict(tier, step, raw or b"", local.manifest_raw, done)
    return durable.UploadReport(step, tier.step_url(step), "committed", len(plans), total, **report)


def same_or_conflict(
    tier: S3Tier, step: int, existing: bytes, ours: bytes, done: durable.UploadReport
) -> durable.UploadReport:
    if existing == ours:
        return done
    raise DurableConflictError(
        f"{tier.step_url(step)}: already committed with other content (another writer's checkpoint of step "
        f"{step}); a committed step is never overwritten"
    )


def plan_file(tier: S3Tier, plan: FilePlan, unfinished: list[str], fresh: bool = False) -> None:
    """What of `plan`'s file the tier holds: the whole object, or an unfinished multipart upload and its parts
    (the oldest: any will do, since a part is kept only where its size and MD5 are those read now, and only the
    parts of this plan are completed)."""
    if not fresh:
        head = tier.head(plan.key)
        if head is not None and head.get("ContentLength") == plan.entry.size:
            plan.done_etag = str(head.get("ETag", "")).strip('"')
            return
    if plan.single:
        return
    if unfinished and not fresh:
        try:
            plan.upload_id, plan.have = unfinished[0], tier.parts_of(plan.key, unfinished[0])
            return
        except UploadGone:  # dropped since it was listed: a new one
            plan.upload_id, plan.have = None, {}
    created = tier.on_object(
        "start an upload of",
        plan.key,
        tier.client.create_multipart_upload,
        Metadata={"ftsup-checksum": plan.entry.checksum},
    )
    plan.upload_id = str(created["UploadId"])


def send_plans(
    tier: S3Tier,
    pool: ThreadPoolExecutor,
    local: durable.LocalCheckpoint,
    plans: list[FilePlan],
    report: dict[str, int],
    on_part: durable.PartHook | None,
    pause: durable.PauseHook | None = None,
) -> list[FilePlan]:
    """Send (or check) every part of `plans`, complete each file; the plans whose object must be written again."""
    futures = {
        pool.submit(_part, tier, local, p, n, on_part, pause): (p, n) for p in plans for n in range(1, len(p.parts) + 1)
    }
    left = {id(p): len(p.parts) for p in plans}
    gone: set[int] = set()
    retry: list[FilePlan] = []
    pending: set[Future[tuple[int, str]]] = set(futures)
    try:
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in finished:
                plan, _ = futures[f]
                try:
                    sent, how = f.result()  # a part's failure is raised here
                except UploadGone:
                    gone.add(id(plan))
                    sent, how = 0, "gone"
                report["bytes_sent"] += sent
                if how in ("sent", "kept"):  # a part of an object that was there counts once its file is judged
                    report["parts_sent" if how == "sent" else "parts_kept"] += 1
                left[id(plan)] -= 1
                if left[id(plan)] == 0:
                    if id(plan) in gone or not _finish(tier, local, plan):
                        retry.append(plan)
                    elif plan.done_etag is not None:
                        report["parts_kept"] += len(plan.parts)
    except BaseException:
        for other in pending:  # nothing more is sent for an upload that failed
            other.cancel()
        wait(pending)
        raise
    return retry


def _part(
    tier: S3Tier,
    local: durable.LocalCheckpoint,
    plan: FilePlan,
    number: int,
    on_part: durable.PartHook | None,
    pause: durable.PauseHook | None = None,
) -> tuple[int, str]:
    """Read part `number` of the local file, checksum it, send it unless the tier has it: (bytes sent, "sent",
    "kept" or "checked": read for the check of an object that is there). `pause` is called before the read, between
    the pieces the part is read and hashed in (`_read_part`) and between the pieces of its body as it is sent
    (`_PausingBody`)."""
    if pause is not None:
        pause(math.inf)
    offset, length = plan.parts[number - 1]
    data, plan.crcs[number], md5 = _read_part(local, plan.rel, offset, length, pause)
    plan.md5s[number] = md5
    if plan.done_etag is not None:
        return 0, "checked"  # decided when the file's parts are all checked (`_finish`)
    if not plan.single and plan.have.get(number) == (md5.hex(), length):
        plan.etags[number] = md5.hex()
        return 0, "kept"
    for resend in range(BODY_RESENDS + 1):
        try:
            etag = _send(tier, plan, number, data, md5, pause)
            break
        except BodyTorn:
            if resend == BODY_RESENDS:
                raise
    if not plan.single:
        if etag and len(etag) == 32 and etag != md5.hex():
            raise DurableTierError(
                f"s3://{tier.bucket}/{plan.key}: part {number} stored as {etag}, sent as {md5.hex()}"
            )
        plan.etags[number] = etag or md5.hex()
    if on_part is not None:
        on_part(plan.rel, number)
    return length, "sent"


def _send(
    tier: S3Tier, plan: FilePlan, number: int, data: bytearray, md5: bytes, pause: durable.PauseHook | None
) -> str:
    """Send part `number` (`data`, whose MD5 is `md5`): the ETag the store answers ("" for a file sent whole)."""
    if plan.single:
        tier.put(plan.key, data, metadata={"ftsup-checksum": plan.entry.checksum}, md5=md5)
        return ""
    body = data if pause is None else _PausingBody(data, pause)
    send = tier.client.upload_part
    return _etag_of(tier, plan, "send a part of", send, PartNumber=number, Body=body, ContentMD5=b64(md5))


def _finish(tier: S3Tier, local: durable.LocalCheckpoint, plan: FilePlan) -> bool:
    """Check the whole file's blocks against the manifest and complete its upload; False: write it again."""
    crcs = [c for n in sorted(plan.crcs) for c in plan.crcs[n]]
    why = durable.blocks_problem(plan.entry, crcs, local.manifest.checksum_algorithm)
    if why is not None:
        if plan.upload_id is not None:  # the parts of a bad copy are of no use to anyone
            with contextlib.suppress(DurableTierError):
                tier.abort_upload(plan.key, plan.upload_id)
        raise CheckpointCorruptError(f"{local.path}/{plan.rel}: {why}", path=str(local.path), file=plan.rel)
    md5s = [plan.md5s[n] for n in sorted(plan.md5s)]
    expected = md5s[0].hex() if plan.single else durable.composite_etag(md5s)
    if plan.done_etag is not None:
        plan.mismatched = plan.done_etag != expected
        return not plan.mismatched
    if plan.single:
        return True
    parts = [{"PartNumber": n, "ETag": f'"{plan.etags[n]}"'} for n in sorted(plan.etags)]
    complete = tier.client.complete_multipart_upload
    try:
        etag = _etag_of(tier, plan, "complete the upload of", complete, MultipartUpload={"Parts": parts})
    except UploadGone:
        return False
    if etag.endswith(f"-{len(parts)}") and etag != expected:
        raise DurableTierError(f"s3://{tier.bucket}/{plan.key}: completed as {etag}, expected {expected}")
    return True


def _etag_of(tier: S3Tier, plan: FilePlan, what: str, fn: Any, **kwargs: Any) -> str:
    """The ETag (unquoted; "" for none) of the store's answer to `fn` on the multipart upload of `plan`."""
    answer = tier.on_object(what, plan.key, fn, UploadId=plan.upload_id, **kwargs)
    return str(answer.get("ETag", "")).strip('"')


def _check_objects(tier: S3Tier, step: int, token: str, manifest: layout.Manifest) -> None:
    """Before the commit: every file the manifest names is in the tier at its recorded size."""
    sizes = s3list.object_sizes(tier, tier.key(layout.step_dirname(step), token) + "/", len(manifest.files))
    for rel, entry in sorted(manifest.files.items()):
        size = sizes.get(tier.data_key(step, token, rel))
        if size != entry.size:
            raise DurableTierError(
                f"{tier.step_url(step)}/{token}/{rel}: {'missing' if size is None else f'{size} bytes'} in the "
                f"tier after its upload (recorded {entry.size}); not committed"
            )


# ------------------------------------------------------------------ helpers


class _PausingBody:
    """A part's bytes as a readable body that calls `pause` (for at most `durable.BODY_PAUSE_S`) before each piece it
    hands out (PIECE_BYTES): an upload told to pause stops sending within a piece, instead of after the part.
    Seekable and sized, so that the client knows its length and sends it again from the start when it retries."""

    def __init__(self, data: bytearray, pause: durable.PauseHook) -> None:
        self._view = memoryview(data)
        self._pause = pause
        self._at = 0

    def __len__(self) -> int:
        return len(self._view)

    def read(self, size: int = -1) -> bytes:
        if self._at >= len(self._view):
            return b""
        if self._at:  # the first piece follows the pause before the part's read
            self._pause(durable.BODY_PAUSE_S)
        end = len(self._view) if size is None or size < 0 else self._at + max(size, PIECE_BYTES)
        piece = self._view[self._at : min(end, self._at + PIECE_BYTES, len(self._view))]
        self._at += len(piece)
        return piece.tobytes()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._at, os.SEEK_END: len(self._view)}[whence]
        self._at = min(max(0, base + offset), len(self._view))
        return self._at

    def tell(self) -> int:
        return self._at


def wait_all(futures: list[Future[Any]]) -> None:
    """Wait for `futures`; on the first failure cancel the rest, wait for the running ones, and raise it."""
    done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for other in pending if any(f.exception() is not None for f in done) else ():
        other.cancel()
    wait(pending)
    for f in done:
        f.result()


_buffers = threading.local()


def _read_part(
    local: durable.LocalCheckpoint, rel: str, offset: int, length: int, pause: durable.PauseHook | None
) -> tuple[bytearray, list[int], bytes]:
    """Bytes [offset, offset + length) of the local file, their block checksums and their MD5 digest,
    read into this thread's part buffer: a part is read, hashed and sent before the thread reads the next, so one
    buffer of the part size serves every full part (no new 16 MiB allocation, no page faults, per part); a part of
    another size gets a buffer of its own.

    It is read and hashed a piece (PIECE_BYTES) at a time, with `pause` called between the pieces: an upload told
    to pause stops within a piece's read and hashing, not after the whole part's (a 16 MiB part's MD5 alone is tens
    of milliseconds of CPU, on each of the upload's threads)."""
    buf = getattr(_buffers, "part", None)
    if buf is None or len(buf) != length:
        buf = bytearray(length)
        if length >= durable.MIN_PART_BYTES:
            _buffers.part = buf
    path = safefile.resolve_inside(local.path, rel)
    fd = safefile.open_regular(path, str(path))
    crcs: list[int] = []
    md5 = hashlib.md5()
    try:
        with memoryview(buf) as view:
            for start in range(0, length, PIECE_BYTES):
                if start and pause is not None:
                    pause(math.inf)  # no request is open yet: the hook's own bound applies
                end = min(length, start + PIECE_BYTES)
                got = start
                while got < end:
                    n = os.preadv(fd, [view[got:end]], offset + got)
                    if n <= 0:
                        raise CheckpointCorruptError(
                            f"{path}: shorter than its manifest records", path=str(local.path), file=rel
                        )
                    got += n
                checksums.block_crcs(view[start:end], crcs, algorithm=local.manifest.checksum_algorithm)
                md5.update(view[start:end])
        return buf, crcs, md5.digest()
    finally:
        os.close(fd)


def b64(digest: bytes) -> str:
    """A digest as a Content-MD5 header carries it."""
    return base64.b64encode(digest).decode()
