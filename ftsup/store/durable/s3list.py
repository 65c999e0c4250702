"""Listing, checking and deleting the checkpoints of a durable tier on object storage, every listed name hostile.

Requests go through the tier's own wrappers (`S3Tier.call`); this module has no client of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ftsup.store import layout
from ftsup.store.durable import tier as durable
from ftsup.store.errors import CheckpointError, DurableTierError, NoCheckpointError

if TYPE_CHECKING:
    from ftsup.store.durable.s3 import S3Tier

MANIFEST_MAX_BYTES = 8 << 20
"""The largest manifest a tier on object storage holds (about 32,000 ranks: `layout.MANIFEST_MAX_BYTES` is the
fast tier's). Parsing JSON costs some 15 times its size, and the supervisor parses what the tier sends: this cap
keeps that under its memory bound; an upload of a bigger manifest is refused before anything is sent."""
MAX_NAMES = 100_000
"""Names under a tier's prefix that a listing reads (a run keeps a handful of checkpoints; retention deletes the
rest): a store that answers with more fails the listing, naming the cap."""
PAGE = 1000
MAX_PAGES = 200
"""Pages of one listing read: a store that answers "there is more" for ever (empty pages, the same token) fails the
listing, naming the cap."""


def _base(tier: S3Tier) -> str:
    return f"{tier.location.prefix}/" if tier.location.prefix else ""


def step_names(tier: S3Tier) -> tuple[list[int], list[str]]:
    """(steps, others): the `step-N` folders under the tier's prefix, and every other name there, escaped. A listing
    past MAX_NAMES or MAX_PAGES, or one whose store repeats its token, is a DurableTierError naming the endpoint
    and the cap: the names it left out sort last, and the newest checkpoints are among them."""
    base = _base(tier)
    steps: list[int] = []
    others: list[str] = []
    token: str | None = None
    seen = 0
    for _page in range(MAX_PAGES):
        kwargs: dict[str, Any] = {"Prefix": base, "Delimiter": "/", "MaxKeys": PAGE}
        if token:
            kwargs["ContinuationToken"] = token
        got = tier.call("list", base or "/", tier.client.list_objects_v2, **kwargs)
        for entry in got.get("CommonPrefixes", []) or []:
            name = entry.get("Prefix") if isinstance(entry, dict) else None
            seen += 1
            if not isinstance(name, str) or not name.startswith(base) or not name.endswith("/"):
                others.append(f"{durable.clean_name(str(name))} (a name outside the prefix asked for)")
                continue
            inner = name[len(base) : -1]
            step = layout.parse_step_dirname(inner)
            if step is None:
                others.append(f"{durable.clean_name(inner)}/ (not a checkpoint name)")
            else:
                steps.append(step)
        for obj in got.get("Contents", []) or []:
            seen += 1
            key = obj.get("Key") if isinstance(obj, dict) else None
            inner = key[len(base) :] if isinstance(key, str) and key.startswith(base) else str(key)
            others.append(f"{durable.clean_name(inner)} (an object beside the checkpoints)")
        last, token = token, got.get("NextContinuationToken")
        if not got.get("IsTruncated") or not isinstance(token, str) or not token:
            break
        if seen >= MAX_NAMES:
            raise _past_cap(tier, f"more than {seen} names, past the cap of {MAX_NAMES}")
        if token == last:
            raise _past_cap(tier, "the same continuation token twice")
    else:
        raise _past_cap(tier, f"more than {MAX_PAGES} pages, past the cap of {MAX_PAGES}")
    return sorted(set(steps)), others


def _past_cap(tier: S3Tier, what: str) -> DurableTierError:
    endpoint = durable.clean_name(str(tier.client.meta.endpoint_url), 200)
    return DurableTierError(f"{tier.url}: the listing from {endpoint} ran on ({what}); the rest was not read")


def pages(
    tier: S3Tier,
    what: str,
    key: str,
    fn: Any,
    follow: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None],
    first: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Iterator[dict[str, Any]]:
    """The answers to `tier.call(what, key, fn, **kwargs, **markers)`, page after page, at most MAX_PAGES: the
    markers are `first`, then `follow(answer, markers)` of the page before; it ends where that is None (no more) or
    the markers the page had (a store that repeats itself)."""
    markers = first or {}
    for _page in range(MAX_PAGES):
        got = tier.call(what, key, fn, **kwargs, **markers)
        yield got
        nxt = follow(got, markers)
        if nxt is None or nxt == markers:
            return
        markers = nxt


def _by_token(got: dict[str, Any], markers: dict[str, Any]) -> dict[str, Any] | None:
    """The next page of a `list_objects_v2`."""
    token = got.get("NextContinuationToken")
    if not got.get("IsTruncated") or not isinstance(token, str) or not token:
        return None
    return {"ContinuationToken": token}


def object_sizes(tier: S3Tier, prefix: str, expected: int) -> dict[str, int]:
    """Key -> size of the objects under `prefix`, reading at most `expected` names and a few pages more."""
    sizes: dict[str, int] = {}
    limit = expected + 2 * PAGE
    listing = tier.client.list_objects_v2
    for got in pages(tier, "list", prefix, listing, _by_token, Prefix=prefix, MaxKeys=PAGE):
        for obj in got.get("Contents", []) or []:
            key, size = (obj.get("Key"), obj.get("Size")) if isinstance(obj, dict) else (None, None)
            if isinstance(key, str) and key.startswith(prefix) and type(size) is int and size >= 0:
                sizes[key] = size
        if len(sizes) >= limit:
            break
    return sizes


def uploads_under(tier: S3Tier, prefix: str) -> dict[str, list[str]]:
    """Key -> ids of the unfinished multipart uploads under `prefix`, oldest first (at most MAX_NAMES read)."""
    found: dict[str, list[tuple[str, str]]] = {}
    seen = 0
    listing = tier.client.list_multipart_uploads
    for got in pages(tier, "list the uploads under", prefix, listing, _by_upload, Prefix=prefix, MaxUploads=PAGE):
        for up in got.get("Uploads", []) or []:
            seen += 1
            key, upload_id = (up.get("Key"), up.get("UploadId")) if isinstance(up, dict) else (None, None)
            if isinstance(key, str) and key.startswith(prefix) and isinstance(upload_id, str) and upload_id:
                found.setdefault(key, []).append((str(up.get("Initiated", "")), upload_id))
        if seen >= MAX_NAMES:
            break
    return {key: [i for _, i in sorted(ups)] for key, ups in found.items()}


def _by_upload(got: dict[str, Any], markers: dict[str, Any]) -> dict[str, Any] | None:
    """The next page of a `list_multipart_uploads`."""
    key_marker, id_marker = got.get("NextKeyMarker"), got.get("NextUploadIdMarker")
    if not got.get("IsTruncated") or not isinstance(key_marker, str) or not key_marker:
        return None
    return {"KeyMarker": key_marker, "UploadIdMarker": id_marker if isinstance(id_marker, str) else ""}


def inspect(tier: S3Tier, step: int, *, deep: bool = False) -> layout.CheckpointInfo:
    """The check of the committed checkpoint of `step` (NoCheckpointError when its manifest is not there)."""
    path = tier.step_url(step)
    try:
        manifest, raw = tier.manifest(step)
    except NoCheckpointError:
        raise
    except layout.CheckpointFormatError as e:
        return layout.CheckpointInfo(step, path, False, problems=(layout.Problem(layout.MANIFEST_NAME, str(e), True),))
    except layout.ManifestError as e:
        return layout.CheckpointInfo(step, path, False, problems=(layout.Problem(layout.MANIFEST_NAME, str(e)),))
    token = durable.data_token(raw)
    folder = tier.key(layout.step_dirname(step), token) + "/"
    sizes = object_sizes(tier, folder, len(manifest.files))
    problems: list[layout.Problem] = []
    for rel, entry in sorted(manifest.files.items()):
        size = sizes.get(tier.data_key(step, token, rel))
        if size is None:
            problems.append(layout.Problem(rel, "missing"))
        elif size != entry.size:
            problems.append(layout.Problem(rel, f"size {size} != recorded {entry.size}"))
        if len(problems) >= layout.MAX_PROBLEMS:
            break
    if deep and not problems:
        problems = tier.read_files(step, token, manifest)
    return layout.CheckpointInfo(
        step=step,
        path=path,
        consistent=not problems,
        kind=manifest.kind,
        world_size=manifest.world_size,
        created_unix=manifest.created_unix,
        problems=tuple(problems),
        tensor_bytes=manifest.tensor_bytes,
    )


def listing(tier: S3Tier, *, deep: bool = False) -> durable.DurableListing:
    """Every committed checkpoint of the tier, oldest first, each checked; the other names found."""
    steps, others = step_names(tier)
    found = []
    for step in steps:
        try:
            found.append(inspect(tier, step, deep=deep))
        except NoCheckpointError:
            others.append(f"{layout.step_dirname(step)}/ (no manifest: an upload not committed)")
    return durable.DurableListing(found, others)


def delete(tier: S3Tier, step: int) -> int:
    """Delete the committed checkpoint of `step`: its manifest, then the objects it names, then unfinished uploads
    of those names; the number of objects deleted. A manifest that does not parse deletes nothing (which objects
    are the checkpoint's is unknown): a CheckpointError names it."""
    try:
        manifest, raw = tier.manifest(step)
    except layout.ManifestError as e:
        raise CheckpointError(f"{tier.step_url(step)}: not deleted: {e}") from None
    mkey = tier.manifest_key(step)
    tier.on_object("delete", mkey, tier.client.delete_object)
    return 1 + delete_files(tier, step, durable.data_token(raw), sorted(manifest.files))


def delete_files(tier: S3Tier, step: int, token: str, rels: list[str]) -> int:
    """Delete the objects `rels` of the data folder `token` of `step`, and unfinished uploads of those names; the
    number of objects deleted. Only for a folder no committed manifest names (deleted first, or never committed)."""
    keys = [tier.data_key(step, token, rel) for rel in rels]
    where = f"{tier.step_url(step)}/{token}"
    deleted = 0
    for i in range(0, len(keys), PAGE):
        batch = [{"Key": k} for k in keys[i : i + PAGE]]
        got = tier.call(
            "delete the files of",
            where,
            tier.client.delete_objects,
            Delete={"Objects": batch, "Quiet": True},
        )
        errors = got.get("Errors", []) or []
        if errors:
            first = errors[0] if isinstance(errors[0], dict) else {}
            raise CheckpointError(
                f"{where}: {len(errors)} file(s) not deleted, e.g. "
                f"{durable.clean_name(str(first.get('Key')))}: {durable.clean_name(str(first.get('Code')), 40)}"
            )
        deleted += len(batch)
    named = set(keys)
    for key, ids in uploads_under(tier, tier.key(layout.step_dirname(step), token) + "/").items():
        for upload_id in ids if key in named else []:
            tier.abort_upload(key, upload_id)
    return deleted
