"""One node's part of a checkpoint whose nodes keep separate fast tiers, on object storage: its files, its marker,
and the commit once every node's part is there (ftsup/store/DESIGN.md, Node-local fast tiers).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ftsup.store import layout, nodes
from ftsup.store.durable import s3list, s3upload
from ftsup.store.durable import tier as durable
from ftsup.store.errors import (
    CheckpointCorruptError,
    CheckpointError,
    DurableTierError,
    DurableWaitError,
)

if TYPE_CHECKING:
    from ftsup.store.durable.s3 import S3Tier


class WaitingForNodes(DurableWaitError):
    """This node's part is in the tier, and the commit waits for the other nodes' parts (tried again later)."""


def markers_folder(tier: S3Tier, step: int, token: str) -> str:
    """The folder of a step's node markers, beside its data folder `token` (`data-<hex>` -> `nodes-<hex>/`)."""
    return tier.key(layout.step_dirname(step), "nodes-" + token.removeprefix("data-")) + "/"


def upload(
    tier: S3Tier,
    ckpt_dir: str | os.PathLike[str],
    node: str,
    *,
    on_part: durable.PartHook | None = None,
    pause: durable.PauseHook | None = None,
) -> durable.UploadReport:
    """`S3Tier.upload` of node `node`'s copy of a checkpoint: its files, its marker, then the commit if every
    node's part is there. A checkpoint whose manifest records no nodes is uploaded whole (`s3upload.upload`)."""
    local = s3upload.read_local(ckpt_dir)
    manifest, step = local.manifest, local.manifest.step
    if manifest.nodes is None:
        return s3upload.upload(tier, ckpt_dir, on_part=on_part, pause=pause)
    if node not in manifest.nodes:
        raise CheckpointCorruptError(
            f"{local.path}: its manifest records nodes {sorted(manifest.nodes)}, not this node {node!r}",
            path=str(local.path),
        )
    total = sum(e.size for e in manifest.files.values())
    done = durable.UploadReport(step, tier.step_url(step), "already", len(manifest.files), total)
    existing = tier.manifest_raw(step)
    if existing is not None:
        return s3upload.same_or_conflict(tier, step, existing, local.manifest_raw, done)
    token = local.token
    mine = nodes.sent_by(manifest.files, manifest.nodes, node)
    report = {"bytes_sent": 0, "parts_sent": 0, "parts_kept": 0}
    marker_key = markers_folder(tier, step, token) + f"{node}.json"
    marker = nodes.marker_bytes(node, step, {rel: manifest.files[rel] for rel in mine})
    try:
        marked = read_small(tier, marker_key, nodes.MARKER_MAX_BYTES) == marker
    except DurableTierError:
        raise
    except CheckpointError:
        marked = False  # not this node's marker (too big): written over below
    if not marked:  # not sent yet, or cut short
        _send_files(tier, local, mine, report, on_part, pause)
        # Only this node writes this name, always the same bytes: one that is there otherwise is written over.
        tier.put(marker_key, marker)
    outcome = try_commit(tier, local)
    bits = dict(report, files=len(mine))
    return durable.UploadReport(step, tier.step_url(step), outcome, bits.pop("files"), total, **bits)


class WaitingForLeader(DurableWaitError):
    """A periodic checkpoint that the node of rank 0 has not picked (its marker is not in the tier) yet."""


def follows(tier: S3Tier, ckpt_dir: str | os.PathLike[str], node: str, picked: bool) -> str:
    """The pick that every node of a node-local job agrees on (`ftsup/store/DESIGN.md`, Node-local fast tiers):
    the node of rank 0 (the leader) uploads what it picked by the policy; another node uploads an emergency or
    final checkpoint it picked itself ("go"), and a periodic one only once the leader's marker of that step is in
    the tier ("follow"; WaitingForLeader until then); anything else is "skip". A checkpoint whose manifest records
    no nodes, or not this node, goes as picked (its upload says what is wrong)."""
    local = durable.read_local(ckpt_dir)
    manifest = local.manifest
    if manifest.nodes is None or node not in manifest.nodes:
        return "go" if picked else "skip"
    leader = nodes.node_of_rank(manifest.nodes, 0)
    if leader == node or manifest.kind != "periodic":
        return "go" if picked else "skip"
    step = manifest.step
    if tier.manifest_raw(step) is not None or tier.head(markers_folder(tier, step, local.token) + f"{leader}.json"):
        return "follow"
    raise WaitingForLeader(f"{tier.step_url(step)}: not picked by node {leader} (rank 0) yet")


def sweep(tier: S3Tier, step: int, nodes_of_job: set[str]) -> int:
    """Delete what this job's nodes wrote for the step `step`, which has no manifest in the tier: the files each
    marker of a node of `nodes_of_job` names (in the data folder beside it), then those markers; never an object no
    such marker names. The number of objects deleted. Only for a step that can no longer commit (the caller's)."""
    base = tier.key(layout.step_dirname(step)) + "/"
    got = tier.call("list", base, tier.client.list_objects_v2, Prefix=base, Delimiter="/", MaxKeys=s3list.PAGE)
    folders = [e.get("Prefix") for e in got.get("CommonPrefixes", []) or [] if isinstance(e, dict)]
    found: dict[str, list[tuple[str, str]]] = {}  # data token -> (marker key, node)
    for folder in folders:
        if not isinstance(folder, str) or not folder.startswith(base) or not folder.endswith("/"):
            continue
        name = folder[len(base) : -1]
        if not name.startswith("nodes-") or "/" in name:
            continue
        present = s3list.object_sizes(tier, folder, len(nodes_of_job))
        for node in sorted(nodes_of_job):
            key = f"{folder}{node}.json"
            if key in present:
                found.setdefault("data-" + name.removeprefix("nodes-"), []).append((key, node))
    if tier.manifest_raw(step) is not None:
        return 0  # committed meanwhile: the checkpoint's retention deletes it
    deleted = 0
    for token, marks in sorted(found.items()):
        if not durable.is_token(token):
            continue
        for key, node in marks:
            try:
                raw = read_small(tier, key, nodes.MARKER_MAX_BYTES)
                rels = nodes.parse_marker(raw, node, step, None, f"s3://{tier.bucket}/{key}") if raw is not None else []
            except DurableTierError:
                raise
            except CheckpointError:
                continue  # not a marker of this job's: what it names stays, and so does it
            deleted += s3list.delete_files(tier, step, token, rels)
            tier.on_object("delete", key, tier.client.delete_object)
            deleted += 1
    return deleted


def _send_files(
    tier: S3Tier,
    local: durable.LocalCheckpoint,
    rels: list[str],
    report: dict[str, int],
    on_part: durable.PartHook | None,
    pause: durable.PauseHook | None = None,
) -> None:
    """The files `rels` of the local copy into the tier, as `s3upload.upload` sends a whole checkpoint's."""
    step, token = local.manifest.step, local.token
    plans = [
        s3upload.FilePlan(
            rel,
            local.manifest.files[rel],
            tier.data_key(step, token, rel),
            durable.part_plan(local.manifest.files[rel].size, tier.options.part_bytes),
        )
        for rel in rels
    ]
    unfinished = s3list.uploads_under(tier, tier.key(layout.step_dirname(step), token) + "/")
    with ThreadPoolExecutor(tier.options.concurrency, thread_name_prefix="ftsup-s3") as pool:
        s3upload.wait_all([pool.submit(s3upload.plan_file, tier, p, unfinished.get(p.key, [])) for p in plans])
        retry = s3upload.send_plans(tier, pool, local, plans, report, on_part, pause)
        for _ in range(s3upload.PASSES - 1):
            if not retry:
                break
            for p in retry:
                p.done_etag, p.upload_id, p.md5s, p.crcs, p.etags, p.have = None, None, {}, {}, {}, {}
                s3upload.plan_file(tier, p, [], fresh=p.mismatched)
            retry = s3upload.send_plans(tier, pool, local, retry, report, on_part, pause)
    folder = tier.key(layout.step_dirname(step), token) + "/"
    sizes = s3list.object_sizes(tier, folder, len(local.manifest.files))
    for rel in rels:
        size, want = sizes.get(tier.data_key(step, token, rel)), local.manifest.files[rel].size
        if size != want:
            raise DurableTierError(
                f"{tier.step_url(step)}/{token}/{rel}: {'missing' if size is None else f'{size} bytes'} in the tier "
                f"after its upload (recorded {want}); this node's part is not marked"
            )


def try_commit(tier: S3Tier, local: durable.LocalCheckpoint) -> str:
    """Commit the checkpoint if every node's part is there: "committed" (by this call) or "already" (by another
    node, with the same bytes); WaitingForNodes naming what is missing otherwise."""
    manifest, step, token = local.manifest, local.manifest.step, local.token
    assert manifest.nodes is not None
    folder = markers_folder(tier, step, token)
    present = s3list.object_sizes(tier, folder, len(manifest.nodes))
    markers: dict[str, list[str]] = {}
    for node in sorted(manifest.nodes):
        key = f"{folder}{node}.json"
        if key not in present:
            continue
        try:
            raw = read_small(tier, key, nodes.MARKER_MAX_BYTES)
            if raw is not None:
                markers[node] = nodes.parse_marker(raw, node, step, manifest.files, f"s3://{tier.bucket}/{key}")
        except DurableTierError:
            raise
        except CheckpointError:
            continue  # not a part this checkpoint can count on (too big, not a marker of it): never committed on it
    data = tier.key(layout.step_dirname(step), token) + "/"
    listed = s3list.object_sizes(tier, data, len(manifest.files))
    sizes = {key[len(data) :]: size for key, size in listed.items()}
    waiting = nodes.missing_for_commit(manifest.files, manifest.nodes, markers, sizes)
    if waiting:
        raise WaitingForNodes(f"{tier.step_url(step)}: not committed yet, waiting for {'; '.join(waiting)}")
    try:
        tier.put(tier.manifest_key(step), local.manifest_raw, if_none_match=True)
    except s3upload.PreconditionFailed:
        raw = tier.manifest_raw(step) or b""
        done = durable.UploadReport(step, tier.step_url(step), "already", 0, 0)
        return s3upload.same_or_conflict(tier, step, raw, local.manifest_raw, done).outcome
    return "committed"


def delete_markers(tier: S3Tier, step: int, token: str, manifest: layout.Manifest) -> int:
    """Delete the markers of the nodes `manifest` records (after its manifest and files); the number deleted."""
    if manifest.nodes is None:
        return 0
    folder = markers_folder(tier, step, token)
    keys = [{"Key": f"{folder}{node}.json"} for node in sorted(manifest.nodes)]
    for i in range(0, len(keys), s3list.PAGE):
        tier.call(
            "delete the node markers of",
            folder,
            tier.client.delete_objects,
            Delete={"Objects": keys[i : i + s3list.PAGE], "Quiet": True},
        )
    return len(keys)


def read_small(tier: S3Tier, key: str, cap: int) -> bytes | None:
    """The bytes of the object `key` (at most `cap`: more is refused), None when it is not there."""
    head = tier.head(key)
    if head is None:
        return None
    size = head.get("ContentLength")
    if type(size) is not int or not 0 <= size <= cap:
        raise CheckpointError(f"s3://{tier.bucket}/{key}: {size!r:.40} bytes, not a marker (at most {cap})")
    if size == 0:
        return b""
    got = tier.on_object("read", key, tier.client.get_object, Range=f"bytes=0-{cap}")
    body = got["Body"]
    try:
        data = body.read(cap + 1)
    finally:
        body.close()
    if len(data) > cap:
        raise CheckpointError(f"s3://{tier.bucket}/{key}: over {cap} bytes, not a marker")
    return bytes(data)
