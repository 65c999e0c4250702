"""The durable tier on object storage: any S3-compatible store, through boto3 (the `durable` extra).

The layout (`ftsup/store/DESIGN.md`, "Durable tier"), under `s3://BUCKET/PREFIX/`:

    step-000001200/manifest.json                   the commit: the local manifest's bytes, written last, once
    step-000001200/data-<24 hex>/shard-00000.safetensors   the files it names, under a folder named by its hash
    ...

A checkpoint exists in the tier if and only if its manifest object exists and verifies. Files go first, each in
parallel parts (`DurableOptions.part_bytes`), each part's bytes checked against the manifest's block checksums as they
are read and sent with Content-MD5 (the store refuses a part torn on the way); the manifest goes last with
`If-None-Match: *`, so two writers never both commit a step. An upload that stopped (the store down, the process
killed) resumes: a file whose object is there with the ETag of its parts' MD5s is kept, an unfinished multipart upload
of it is continued with the parts whose MD5 and size match. Everything the store answers is hostile: listed names are
validated, the manifest is read up to its cap, an object must hold exactly the bytes asked for.

Credentials come only from the standard AWS chain (environment variables, `~/.aws/credentials`, `~/.aws/config`,
a role); the endpoint from `DurableOptions.endpoint_url`, else from `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, which
botocore reads. Listing, checking and deleting: `ftsup.store.s3list`.
"""

from __future__ import annotations

import base64
import hashlib
import os
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ftsup.extras import explained
from ftsup.store import checksums, durable, layout, s3list, safefile
from ftsup.store.errors import (
    CheckpointCorruptError,
    DurableConflictError,
    DurableTierError,
    ManifestError,
    NoCheckpointError,
)

try:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError
except ModuleNotFoundError as e:
    raise explained(e, "a durable tier on object storage (s3://)") from None

MANIFEST_PUT_CODES = ("PreconditionFailed", "ConditionalRequestConflict")
_MISSING = ("NoSuchKey", "404", "NotFound", "NoSuchUpload")


class _Precondition(Exception):
    """The store refused a conditional write: the object is there."""


def s3_error(what: str, error: Exception) -> DurableTierError:
    """The DurableTierError for a failed request: what was asked and what the store or the connection said (its
    text is the store's, so escaped and cut short)."""
    if isinstance(error, ClientError):
        info = error.response.get("Error", {})
        said = (
            f"{durable.clean_name(str(info.get('Code', '?')), 40)}: {durable.clean_name(str(info.get('Message', '')))}"
        )
    else:
        said = durable.clean_name(f"{type(error).__name__}: {error}", 300)
    return DurableTierError(f"{what}: {said}")


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


@dataclass
class _FilePlan:
    rel: str
    entry: layout.FileEntry
    key: str
    parts: list[tuple[int, int]]
    done_etag: str | None = None  # the object is there at this size: kept if its ETag is the parts' one
    upload_id: str | None = None
    have: dict[int, tuple[str, int]] = field(default_factory=dict)  # part number -> (ETag, size) already sent
    md5s: dict[int, bytes] = field(default_factory=dict)
    crcs: dict[int, list[int]] = field(default_factory=dict)
    etags: dict[int, str] = field(default_factory=dict)

    @property
    def single(self) -> bool:
        return len(self.parts) == 1


class S3Tier(durable.DurableTier):
    """A durable tier at `s3://bucket/prefix` (see the module docstring)."""

    def __init__(self, location: durable.Location, options: durable.DurableOptions) -> None:
        if location.bucket is None:
            raise ValueError("not an s3:// location")
        self.location = location
        self.options = options
        self.bucket = location.bucket
        config = Config(
            connect_timeout=options.connect_timeout_s,
            read_timeout=options.read_timeout_s,
            retries={"max_attempts": options.max_attempts, "mode": "standard"},
            max_pool_connections=max(10, options.concurrency * 2),
            # Every part carries Content-MD5 and is checked against the manifest's CRC-32C blocks: no third sum.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if options.endpoint_url else None,
        )
        try:
            self.client: Any = boto3.session.Session().client(
                "s3", endpoint_url=options.endpoint_url, region_name=options.region, config=config
            )
        except (BotoCoreError, ValueError) as e:
            raise s3_error(f"{self.url}: cannot make an S3 client", e) from None

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ keys

    def key(self, *names: str) -> str:
        return "/".join([self.location.prefix, *names] if self.location.prefix else names)

    def manifest_key(self, step: int) -> str:
        return self.key(layout.step_dirname(step), layout.MANIFEST_NAME)

    def data_key(self, step: int, token: str, rel: str) -> str:
        return self.key(layout.step_dirname(step), token, safefile.validate_relpath(rel))

    # ------------------------------------------------------------------ reads

    def manifest_raw(self, step: int) -> bytes | None:
        """The bytes of the manifest object of `step` (at most MANIFEST_MAX_BYTES), or None when there is none."""
        key = self.manifest_key(step)
        cap = layout.MANIFEST_MAX_BYTES
        where = f"s3://{self.bucket}/{key}"
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{cap}")
        except ClientError as e:
            if _code(e) in _MISSING or _code(e) == "InvalidRange":  # InvalidRange: an empty object
                if _code(e) == "InvalidRange":
                    raise ManifestError(f"{where}: empty") from None
                return None
            raise s3_error(f"{where}: cannot read", e) from None
        except BotoCoreError as e:
            raise s3_error(f"{where}: cannot read", e) from None
        total = _total_size(got)
        body = got["Body"]
        try:
            if total is not None and total > cap:
                raise ManifestError(f"{where}: {total} bytes, over the {cap}-byte limit for a manifest; refusing it")
            raw = body.read(cap + 1)
        except BotoCoreError as e:
            raise s3_error(f"{where}: cannot read", e) from None
        finally:
            body.close()
        if len(raw) > cap:
            raise ManifestError(f"{where}: over the {cap}-byte limit for a manifest; refusing it")
        return bytes(raw)

    def manifest(self, step: int) -> tuple[layout.Manifest, bytes]:
        raw = self.manifest_raw(step)
        if raw is None:
            raise NoCheckpointError(f"{self.step_url(step)}: no manifest (not committed in the durable tier)")
        where = f"{self.step_url(step)}/{layout.MANIFEST_NAME}"
        manifest = layout.parse_manifest(raw, where)
        if manifest.step != step:
            raise ManifestError(f"{where}: records step {manifest.step} but lives in {layout.step_dirname(step)}")
        return manifest, raw

    def read_range(self, step: int, token: str, rel: str, offset: int, length: int) -> bytes:
        key = self.data_key(step, token, rel)
        where = f"s3://{self.bucket}/{key}"
        if length == 0:
            return b""
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
            body = got["Body"]
            try:
                data = body.read(length + 1)
            finally:
                body.close()
        except ClientError as e:
            if _code(e) in _MISSING or _code(e) == "InvalidRange":
                raise CheckpointCorruptError(f"{where}: missing or shorter than the manifest records", file=rel) from e
            raise s3_error(f"{where}: cannot read", e) from None
        except BotoCoreError as e:
            raise s3_error(f"{where}: cannot read", e) from None
        if len(data) != length:
            raise CheckpointCorruptError(f"{where}: {len(data)} bytes at {offset}, asked for {length}", file=rel)
        return bytes(data)

    def list_checkpoints(self, *, deep: bool = False) -> durable.DurableListing:
        return s3list.listing(self, deep=deep)

    def inspect(self, step: int, *, deep: bool = False) -> layout.CheckpointInfo:
        return s3list.inspect(self, step, deep=deep)

    def delete(self, step: int) -> int:
        return s3list.delete(self, step)

    # ------------------------------------------------------------------ upload

    def upload(
        self, ckpt_dir: str | os.PathLike[str], *, on_part: durable.PartHook | None = None
    ) -> durable.UploadReport:
        local = durable.read_local(ckpt_dir)
        step = local.manifest.step
        report = {"bytes_sent": 0, "parts_sent": 0, "parts_kept": 0}
        total = sum(e.size for e in local.manifest.files.values())
        done = durable.UploadReport(step, self.step_url(step), "already", len(local.manifest.files), total)
        existing = self.manifest_raw(step)
        if existing is not None:
            return self._same_or_conflict(step, existing, local.manifest_raw, done)
        token = local.token
        plans = [
            _FilePlan(rel, e, self.data_key(step, token, rel), durable.part_plan(e.size, self.options.part_bytes))
            for rel, e in sorted(local.manifest.files.items())
        ]
        unfinished = s3list.uploads_under(self, self.key(layout.step_dirname(step), token) + "/")
        with ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="ftsup-s3") as pool:
            _all([pool.submit(self._plan, p, unfinished.get(p.key, [])) for p in plans])
            retry = self._send(pool, local, plans, report, on_part)
            if retry:  # objects that were there but not as this upload would write them: written again
                for p in retry:
                    p.done_etag, p.md5s, p.crcs, p.etags, p.have = None, {}, {}, {}, {}
                    self._plan(p, [], fresh=True)
                self._send(pool, local, retry, report, on_part)
        self._check_objects(step, token, local.manifest)
        try:
            self._put(self.manifest_key(step), local.manifest_raw, if_none_match=True)
        except _Precondition:
            raw = self.manifest_raw(step)
            return self._same_or_conflict(step, raw or b"", local.manifest_raw, done)
        return durable.UploadReport(step, self.step_url(step), "committed", len(plans), total, **report)

    def _same_or_conflict(
        self, step: int, existing: bytes, ours: bytes, done: durable.UploadReport
    ) -> durable.UploadReport:
        if existing == ours:
            return done
        raise DurableConflictError(
            f"{self.step_url(step)}: already committed with other content (another writer's checkpoint of step "
            f"{step}); a committed step is never overwritten"
        )

    def _plan(self, plan: _FilePlan, unfinished: list[str], fresh: bool = False) -> None:
        """What of `plan`'s file the tier holds: the whole object, or a multipart upload and its parts."""
        if not fresh:
            head = self._head(plan.key)
            if head is not None and head["ContentLength"] == plan.entry.size:
                plan.done_etag = str(head.get("ETag", "")).strip('"')
                return
        if plan.single:
            return
        if not fresh:
            for upload_id in unfinished:
                have = self._parts_of(plan.key, upload_id)
                if all(n <= len(plan.parts) and size == plan.parts[n - 1][1] for n, (_, size) in have.items()):
                    plan.upload_id, plan.have = upload_id, have
                    return
        created = self._call(
            "start an upload of", plan.key, self.client.create_multipart_upload, Bucket=self.bucket, Key=plan.key
        )
        plan.upload_id = str(created["UploadId"])

    def _send(
        self,
        pool: ThreadPoolExecutor,
        local: durable.LocalCheckpoint,
        plans: list[_FilePlan],
        report: dict[str, int],
        on_part: durable.PartHook | None,
    ) -> list[_FilePlan]:
        """Send (or check) every part of `plans`, complete each file; the plans whose object must be written again."""
        futures = {
            pool.submit(self._part, local, p, n, on_part): (p, n) for p in plans for n in range(1, len(p.parts) + 1)
        }
        left = {id(p): len(p.parts) for p in plans}
        retry: list[_FilePlan] = []
        pending: set[Future[tuple[int, bool]]] = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in finished:
                if f.exception() is not None:
                    for other in pending:
                        other.cancel()
                    wait(pending)
                    raise f.exception()  # type: ignore[misc]
                plan, _ = futures[f]
                sent, kept = f.result()
                report["bytes_sent"] += sent
                report["parts_sent" if sent or not kept else "parts_kept"] += 1
                left[id(plan)] -= 1
                if left[id(plan)] == 0 and not self._finish(local, plan):
                    retry.append(plan)
        return retry

    def _part(
        self, local: durable.LocalCheckpoint, plan: _FilePlan, number: int, on_part: durable.PartHook | None
    ) -> tuple[int, bool]:
        """Read part `number` of the local file, checksum it, send it unless the tier has it; (bytes sent, kept)."""
        offset, length = plan.parts[number - 1]
        data = _pread(local.path, plan.rel, offset, length)
        plan.crcs[number] = checksums.block_crcs(data, algorithm=local.manifest.checksum_algorithm)
        md5 = hashlib.md5(data)
        plan.md5s[number] = md5.digest()
        if plan.done_etag is not None:
            return 0, True  # decided when the file's parts are all checked (`_finish`)
        if plan.single:
            self._put(plan.key, data, metadata={"ftsup-checksum": plan.entry.checksum})
        elif plan.have.get(number) == (md5.hexdigest(), length):
            plan.etags[number] = md5.hexdigest()
            return 0, True
        else:
            sent = self._call(
                "send a part of", plan.key, self.client.upload_part, Bucket=self.bucket, Key=plan.key,
                UploadId=plan.upload_id, PartNumber=number, Body=data, ContentMD5=_b64(md5.digest()),
            )  # fmt: skip
            etag = str(sent.get("ETag", "")).strip('"')
            if etag and len(etag) == 32 and etag != md5.hexdigest():
                raise DurableTierError(
                    f"s3://{self.bucket}/{plan.key}: part {number} stored as {etag}, sent as {md5.hexdigest()}"
                )
            plan.etags[number] = etag or md5.hexdigest()
        if on_part is not None:
            on_part(plan.rel, number)
        return length, False

    def _finish(self, local: durable.LocalCheckpoint, plan: _FilePlan) -> bool:
        """Check the whole file's blocks against the manifest and complete its upload; False: write it again."""
        crcs = [c for n in sorted(plan.crcs) for c in plan.crcs[n]]
        durable.check_blocks(str(local.path), plan.rel, plan.entry, crcs, local.manifest.checksum_algorithm)
        md5s = [plan.md5s[n] for n in sorted(plan.md5s)]
        expected = md5s[0].hex() if plan.single else durable.composite_etag(md5s)
        if plan.done_etag is not None:
            return plan.done_etag == expected
        if plan.single:
            return True
        parts = [{"PartNumber": n, "ETag": f'"{plan.etags[n]}"'} for n in sorted(plan.etags)]
        done = self._call(
            "complete the upload of", plan.key, self.client.complete_multipart_upload, Bucket=self.bucket,
            Key=plan.key, UploadId=plan.upload_id, MultipartUpload={"Parts": parts},
        )  # fmt: skip
        etag = str(done.get("ETag", "")).strip('"')
        if etag.endswith(f"-{len(parts)}") and etag != expected:
            raise DurableTierError(f"s3://{self.bucket}/{plan.key}: completed as {etag}, expected {expected}")
        return True

    def _check_objects(self, step: int, token: str, manifest: layout.Manifest) -> None:
        """Before the commit: every file the manifest names is in the tier at its recorded size."""
        sizes = s3list.object_sizes(self, self.key(layout.step_dirname(step), token) + "/", len(manifest.files))
        for rel, entry in sorted(manifest.files.items()):
            size = sizes.get(self.data_key(step, token, rel))
            if size != entry.size:
                raise DurableTierError(
                    f"{self.step_url(step)}/{token}/{rel}: {'missing' if size is None else f'{size} bytes'} in the "
                    f"tier after its upload (recorded {entry.size}); not committed"
                )

    # ------------------------------------------------------------------ requests

    def _call(self, what: str, key: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except (ClientError, BotoCoreError) as e:
            if isinstance(e, ClientError) and _code(e) == "BadDigest":
                raise DurableTierError(f"s3://{self.bucket}/{key}: arrived torn (Content-MD5 refused)") from None
            raise s3_error(f"s3://{self.bucket}/{key}: cannot {what}", e) from None

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=key))
        except ClientError as e:
            if _code(e) in _MISSING:
                return None
            raise s3_error(f"s3://{self.bucket}/{key}: cannot look up", e) from None
        except BotoCoreError as e:
            raise s3_error(f"s3://{self.bucket}/{key}: cannot look up", e) from None

    def _put(
        self, key: str, data: bytes, *, if_none_match: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "Body": data,
            "ContentMD5": _b64(hashlib.md5(data).digest()),
        }
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if metadata:
            kwargs["Metadata"] = metadata
        try:
            self.client.put_object(**kwargs)
        except ClientError as e:
            if if_none_match and _code(e) in MANIFEST_PUT_CODES:
                raise _Precondition() from None
            raise s3_error(f"s3://{self.bucket}/{key}: cannot write", e) from None
        except BotoCoreError as e:
            raise s3_error(f"s3://{self.bucket}/{key}: cannot write", e) from None

    def _parts_of(self, key: str, upload_id: str) -> dict[int, tuple[str, int]]:
        """The parts an unfinished upload holds: number -> (ETag, size); the pages capped at MAX_PARTS parts."""
        parts: dict[int, tuple[str, int]] = {}
        marker = 0
        while len(parts) <= durable.MAX_PARTS:
            got = self._call(
                "list the parts of", key, self.client.list_parts, Bucket=self.bucket, Key=key, UploadId=upload_id,
                PartNumberMarker=marker,
            )  # fmt: skip
            for p in got.get("Parts", []) or []:
                n, etag, size = p.get("PartNumber"), p.get("ETag"), p.get("Size")
                if type(n) is int and 1 <= n <= durable.MAX_PARTS and isinstance(etag, str) and type(size) is int:
                    parts[n] = (etag.strip('"'), size)
            nxt = got.get("NextPartNumberMarker")
            if not got.get("IsTruncated") or type(nxt) is not int or nxt <= marker:
                break
            marker = nxt
        return parts


def _all(futures: list[Future[Any]]) -> None:
    """Wait for `futures`; on the first failure cancel the rest, wait for the running ones, and raise it."""
    done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in done:
        if f.exception() is not None:
            for other in pending:
                other.cancel()
            wait(pending)
            raise f.exception()  # type: ignore[misc]


def _pread(ckpt: os.PathLike[str] | str, rel: str, offset: int, length: int) -> bytes:
    path = safefile.resolve_inside(ckpt, rel)
    fd = safefile.open_regular(path, str(path))
    try:
        chunks, got = [], 0
        while got < length:
            chunk = os.pread(fd, length - got, offset + got)
            if not chunk:
                raise CheckpointCorruptError(f"{path}: shorter than its manifest records", path=str(ckpt), file=rel)
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _total_size(got: dict[str, Any]) -> int | None:
    """The object's whole size from a ranged GET's Content-Range (`bytes 0-99/1234`), if the store sent one."""
    rng = str(got.get("ContentRange") or "")
    total = rng.rpartition("/")[2]
    return int(total) if total.isdigit() and len(total) < 20 else None
