"""The durable tier on object storage, through boto3 (the `durable` extra): the client, the keys, the reads and the
requests, every answer read as hostile (ftsup/store/DESIGN.md, Durable tier).

The upload is `s3upload`'s; listing, checking and deleting `s3list`'s.
"""

from __future__ import annotations

import hashlib
import os
import threading
import urllib.parse
from typing import Any

from ftsup.extras import explained
from ftsup.store import layout, safefile
from ftsup.store.durable import s3list, s3nodes, s3upload
from ftsup.store.durable import tier as durable
from ftsup.store.durable.backend import Backend
from ftsup.store.errors import (
    CheckpointCorruptError,
    DurableTierError,
    ManifestError,
    NoCheckpointError,
)

try:
    import boto3
    import botocore.session
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    from ftsup.store.durable import s3http
except ModuleNotFoundError as e:
    raise explained(e, "a durable tier on object storage (s3://)") from None

MANIFEST_PUT_CODES = ("PreconditionFailed", "ConditionalRequestConflict")
_MISSING = ("NoSuchKey", "404", "NotFound", "NoSuchUpload")
_PARSING = threading.Lock()  # one manifest parsed at a time in a process: its memory is bounded once, not per thread


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


class S3Tier(Backend):
    """A durable tier at `s3://bucket/prefix` (see the module docstring)."""

    def __init__(self, location: durable.Location, options: durable.DurableOptions) -> None:
        if location.bucket is None:
            raise ValueError("not an s3:// location")
        super().__init__(location, options)
        self.bucket = location.bucket
        self.transport: s3http.Transport | None = None
        try:
            self.client: Any = self._client(None)
            if not _is_aws(str(self.client.meta.endpoint_url)):
                # Another S3-compatible store (set by endpoint_url or AWS_ENDPOINT_URL_S3): bucket.host names do not
                # resolve there as they do on AWS, so the bucket goes in the path.
                self.close()
                self.client = self._client("path")
        except (BotoCoreError, ValueError) as e:
            raise s3_error(f"{self.url}: cannot make an S3 client", e) from None

    def _client(self, addressing: str | None) -> Any:
        """A boto3 client whose requests go through a `s3http.Transport`: every answer capped and bounded in time."""
        options = self.options
        config = Config(
            connect_timeout=options.connect_timeout_s,
            read_timeout=options.read_timeout_s,
            retries={"max_attempts": options.max_attempts, "mode": "standard"},
            max_pool_connections=max(10, options.concurrency * 2),
            # Every part carries Content-MD5 and is checked against the manifest's CRC-32C blocks: no third sum.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": addressing} if addressing else None,
        )
        core = botocore.session.get_session()
        session = boto3.session.Session(botocore_session=core)
        client = session.client("s3", endpoint_url=options.endpoint_url, region_name=options.region, config=config)
        _sign_parts_by_md5(client)
        limits = s3http.Limits(
            connect_s=options.connect_timeout_s,
            idle_s=options.read_timeout_s,
            request_s=options.request_timeout_s,
            pool=max(10, options.concurrency * 2),
            ends_at=lambda: self.ends_at,
            budget_s=lambda: self.budget_s,
        )
        self.transport = s3http.Transport(limits, core.get_config_variable("ca_bundle"))
        self.transport.install(client)
        return client

    def close(self) -> None:
        self.client.close()
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ keys

    def key(self, *names: str) -> str:
        return "/".join([self.location.prefix, *names] if self.location.prefix else names)

    def manifest_key(self, step: int) -> str:
        return self.key(layout.step_dirname(step), layout.MANIFEST_NAME)

    def data_key(self, step: int, token: str, rel: str) -> str:
        return self.key(layout.step_dirname(step), token, safefile.validate_relpath(rel))

    # ------------------------------------------------------------------ reads

    def manifest_raw(self, step: int) -> bytes | None:
        """The bytes of the manifest object of `step` (at most `s3list.MANIFEST_MAX_BYTES`), or None when there is
        none."""
        key = self.manifest_key(step)
        cap = s3list.MANIFEST_MAX_BYTES
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
        with _PARSING:
            manifest = layout.parse_manifest(raw, where)
        if manifest.step != step:
            raise ManifestError(f"{where}: records step {manifest.step} but lives in {layout.step_dirname(step)}")
        return manifest, raw

    def read_into(
        self, step: int, token: str, rel: str, offset: int, length: int, piece: int, each: durable.PieceHook
    ) -> None:
        """One ranged GET. Whatever length the answer says, it is read no further than one byte past the range."""
        key = self.data_key(step, token, rel)
        where = f"s3://{self.bucket}/{key}"
        if length == 0:
            each(offset, b"")
            return
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
            body = got["Body"]
            try:
                done = 0
                while done < length:
                    want = min(piece, length - done)
                    # whole pieces (a short read is completed): the block checksums stay aligned
                    data = safefile.read_full(lambda count, _: body.read(count), want)
                    if len(data) < want:
                        raise CheckpointCorruptError(
                            f"{where}: {done + len(data)} bytes at {offset}, asked for {length}", file=rel
                        )
                    each(offset + done, data)
                    done += want
                if body.read(1):
                    raise CheckpointCorruptError(
                        f"{where}: more than {length} bytes at {offset}, asked for {length}", file=rel
                    )
            finally:
                body.close()
        except ClientError as e:
            if _code(e) in _MISSING or _code(e) == "InvalidRange":
                raise CheckpointCorruptError(f"{where}: missing or shorter than the manifest records", file=rel) from e
            raise s3_error(f"{where}: cannot read", e) from None
        except BotoCoreError as e:
            raise s3_error(f"{where}: cannot read", e) from None

    # Each read below is one operation, bounded by `options.operation_timeout_s` (or a caller's shorter deadline).

    def list_checkpoints(self, *, deep: bool = False) -> durable.DurableListing:
        with self.deadline():
            return s3list.listing(self, deep=deep)

    def committed_steps(self) -> list[int]:
        with self.deadline():
            return s3list.step_names(self)[0]

    def inspect(self, step: int, *, deep: bool = False) -> layout.CheckpointInfo:
        with self.deadline():
            return s3list.inspect(self, step, deep=deep)

    def delete(self, step: int) -> int:
        with self.deadline():
            try:  # a node-local job's checkpoint: its nodes' markers go after its files
                manifest, raw = self.manifest(step)
            except ManifestError:
                return s3list.delete(self, step)  # which says why nothing is deleted
            removed = s3list.delete(self, step)
            return removed + s3nodes.delete_markers(self, step, durable.data_token(raw), manifest)

    # ------------------------------------------------------------------ upload

    def upload(
        self,
        ckpt_dir: str | os.PathLike[str],
        *,
        on_part: durable.PartHook | None = None,
        node: str | None = None,
        pause: durable.PauseHook | None = None,
    ) -> durable.UploadReport:
        if node is not None:
            return s3nodes.upload(self, ckpt_dir, node, on_part=on_part, pause=pause)
        return s3upload.upload(self, ckpt_dir, on_part=on_part, pause=pause)

    def follows(self, ckpt_dir: str | os.PathLike[str], node: str, picked: bool) -> str:
        return s3nodes.follows(self, ckpt_dir, node, picked)

    def sweep(self, step: int, nodes: set[str]) -> int:
        with self.deadline():
            return s3nodes.sweep(self, step, nodes)

    def call(self, what: str, key: str, fn: Any, **kwargs: Any) -> Any:
        """`fn(Bucket=this tier's bucket, **kwargs)`, its errors made DurableTierErrors naming `key` and `what`
        it could not do."""
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError) as e:
            if (torn := self._torn(key, what, e)) is not None:
                raise torn from None
            if isinstance(e, ClientError) and _code(e) == "NoSuchUpload":
                raise s3upload.UploadGone(f"s3://{self.bucket}/{key}: its multipart upload is gone") from None
            raise s3_error(f"s3://{self.bucket}/{key}: cannot {what}", e) from None

    def _torn(self, key: str, what: str, e: Exception) -> s3upload.BodyTorn | None:
        """The BodyTorn for a store's answer that a request's body did not arrive whole; None for any other error."""
        code = _code(e) if isinstance(e, ClientError) else ""
        if code == "BadDigest":
            return s3upload.BodyTorn(f"s3://{self.bucket}/{key}: arrived torn (Content-MD5 refused)")
        if code in s3upload.SHORT_BODY_CODES:
            return s3upload.BodyTorn(str(s3_error(f"s3://{self.bucket}/{key}: arrived short: cannot {what}", e)))
        return None

    def on_object(self, what: str, key: str, fn: Any, **kwargs: Any) -> Any:
        """`call` of an operation on the object `key` (its Key, as its errors name it)."""
        return self.call(what, key, fn, Key=key, **kwargs)

    def abort_upload(self, key: str, upload_id: str) -> None:
        self.on_object("abort an upload of", key, self.client.abort_multipart_upload, UploadId=upload_id)

    def head(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=key))
        except ClientError as e:
            if _code(e) in _MISSING:
                return None
            raise s3_error(f"s3://{self.bucket}/{key}: cannot look up", e) from None
        except BotoCoreError as e:
            raise s3_error(f"s3://{self.bucket}/{key}: cannot look up", e) from None

    def put(
        self,
        key: str,
        data: bytes | bytearray,
        *,
        if_none_match: bool = False,
        metadata: dict[str, str] | None = None,
        md5: bytes | None = None,
    ) -> None:
        """Write `data` to `key` with its Content-MD5 (`md5`: its digest, when the caller has it already)."""
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "Body": data,
            "ContentMD5": s3upload.b64(md5 if md5 is not None else hashlib.md5(data).digest()),
        }
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if metadata:
            kwargs["Metadata"] = metadata
        try:
            self.client.put_object(**kwargs)
        except ClientError as e:
            if if_none_match and _code(e) in MANIFEST_PUT_CODES:
                raise s3upload.PreconditionFailed() from None
            if (torn := self._torn(key, "write", e)) is not None:
                raise torn from None
            raise s3_error(f"s3://{self.bucket}/{key}: cannot write", e) from None
        except BotoCoreError as e:
            raise s3_error(f"s3://{self.bucket}/{key}: cannot write", e) from None

    def parts_of(self, key: str, upload_id: str) -> dict[int, tuple[str, int]]:
        """The parts an unfinished upload holds: number -> (ETag, size), from at most `s3list.MAX_PAGES` pages."""
        parts: dict[int, tuple[str, int]] = {}
        first = {"PartNumberMarker": 0}
        listing = self.client.list_parts
        for got in s3list.pages(self, "list the parts of", key, listing, _by_part, first, Key=key, UploadId=upload_id):
            for p in got.get("Parts", []) or []:
                n, etag, size = p.get("PartNumber"), p.get("ETag"), p.get("Size")
                if type(n) is int and 1 <= n <= durable.MAX_PARTS and isinstance(etag, str) and type(size) is int:
                    parts[n] = (etag.strip('"'), size)
        return parts


def _by_part(got: dict[str, Any], markers: dict[str, Any]) -> dict[str, Any] | None:
    """The next page of a `list_parts`: a part number past the page's, below the most parts an upload has."""
    nxt = got.get("NextPartNumberMarker")
    if not got.get("IsTruncated") or type(nxt) is not int or not markers["PartNumberMarker"] < nxt < durable.MAX_PARTS:
        return None
    return {"PartNumberMarker": nxt}


def _sign_parts_by_md5(client: Any) -> None:
    """A body sent with Content-MD5 is signed through that header, not hashed a second time for the signature.

    SigV4 signs the request's headers, Content-MD5 among them, and the payload's SHA-256 unless the request says
    UNSIGNED-PAYLOAD. botocore leaves the payload unsigned when a request carries Content-MD5 over HTTPS, and hashes
    every byte with SHA-256 over plain HTTP. Every part and object this tier writes carries the signed Content-MD5 of
    its bytes, which the store checks (a torn part is refused), so over either scheme it is sent as botocore sends it
    over HTTPS: one hash of each byte, not two. A request without Content-MD5 is signed as botocore signs it.
    """
    config = client.meta.config
    unsigned = config.merge(Config(s3={**(config.s3 or {}), "payload_signing_enabled": False}))

    def by_md5(request: Any, **_: Any) -> None:
        if "Content-MD5" in request.headers:
            request.context["client_config"] = unsigned

    for operation in ("UploadPart", "PutObject"):
        client.meta.events.register(f"before-sign.s3.{operation}", by_md5)


def _is_aws(endpoint: str) -> bool:
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


def _total_size(got: dict[str, Any]) -> int | None:
    """The object's whole size from a ranged GET's Content-Range (`bytes 0-99/1234`), if the store sent one."""
    rng = str(got.get("ContentRange") or "")
    total = rng.rpartition("/")[2]
    if total.isdigit() and len(total) < 20:
        return int(total)
    length = got.get("ContentLength")  # a store that ignored the range sent the whole object
    return length if not rng and type(length) is int else None
