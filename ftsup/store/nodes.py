"""Checkpoints of a job whose nodes each keep their own fast tier (`checkpoint.dir_shared: false`).

The manifest's `nodes` field and a node's `node.json` (parsed as hostile input), which files a node holds, the
durable tier's node markers and commit rule (ftsup/store/DESIGN.md, Node-local fast tiers). Stdlib only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ftsup.store import safefile
from ftsup.store.errors import ManifestError

NODE_FILE = "node.json"
"""In a node-local store's `step-N/`: the node whose files this directory holds (not listed in the manifest)."""
NODE_FILE_MAX_BYTES = 4096
SUBSET_FILE = "subset.json"
"""In a `step-N.subset/` directory (`layout.subset_dirname`): the files of the manifest that copy holds (not listed in
the manifest). Honoured in a directory of that name only: a committed `step-N/` holding one still holds every file."""
MARKER_MAX_BYTES = 16 << 20
MAX_NODES = 4096
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_RANKED = re.compile(r"^(?:shard|rank)-(\d{5,9})\.")
_MARKER = re.compile(r"^node-([A-Za-z0-9][A-Za-z0-9._-]{0,63})\.json$")

Nodes = Mapping[str, tuple[int, ...]]
T = TypeVar("T")


def is_node_id(name: object) -> bool:
    return isinstance(name, str) and bool(_NODE_ID.match(name))


def parse_nodes(value: object, world_size: int, where: str) -> dict[str, tuple[int, ...]]:
    """The manifest's `nodes` field: node id -> its ranks, every rank of `world_size` on exactly one node; raises
    ManifestError naming what is wrong."""
    if not isinstance(value, dict) or not value:
        raise ManifestError(f"{where}: nodes must be a non-empty object (node id -> ranks)")
    if len(value) > MAX_NODES:
        raise ManifestError(f"{where}: nodes names {len(value)} nodes, more than {MAX_NODES}")
    seen: set[int] = set()
    out: dict[str, tuple[int, ...]] = {}
    for node, ranks in value.items():
        if not is_node_id(node):
            raise ManifestError(f"{where}: nodes: {node!r:.80} is not a node id")
        if not isinstance(ranks, list) or not ranks:
            raise ManifestError(f"{where}: nodes[{node!r}] must be a non-empty list of ranks")
        for r in ranks:
            if type(r) is not int or not 0 <= r < world_size:
                raise ManifestError(f"{where}: nodes[{node!r}] holds {r!r:.40}, not a rank of world size {world_size}")
            if r in seen:
                raise ManifestError(f"{where}: nodes: rank {r} is on more than one node")
            seen.add(r)
        out[node] = tuple(sorted(ranks))
    if len(seen) != world_size:
        missing = sorted(set(range(world_size)) - seen)[:5]
        raise ManifestError(f"{where}: nodes: ranks {missing} of world size {world_size} are on no node")
    return out


def rank_of(rel: str) -> int | None:
    """The rank a file of a checkpoint belongs to (`shard-00003.safetensors` -> 3), None for a file of every node."""
    m = _RANKED.match(rel)
    return int(m.group(1)) if m and "/" not in rel else None


def node_of_rank(nodes: Nodes, rank: int) -> str | None:
    for node, ranks in nodes.items():
        if rank in ranks:
            return node
    return None


def held_by(files: Mapping[str, Any], nodes: Nodes, node: str) -> list[str]:
    """The files of `files` that `node`'s directory holds: its ranks' files and those of every node."""
    ranks = set(nodes.get(node, ()))
    return sorted(rel for rel in files if (r := rank_of(rel)) is None or r in ranks)


def sent_by(files: Mapping[str, Any], nodes: Nodes, node: str) -> list[str]:
    """The files `node` sends to the durable tier: its ranks' files, and those of every node where it holds rank 0."""
    ranks = set(nodes.get(node, ()))
    return sorted(rel for rel in files if ((r := rank_of(rel)) is None and 0 in ranks) or r in ranks)


def held_files(
    ckpt_dir: str | os.PathLike[str], files: Mapping[str, T], nodes: Nodes | None, *, subset: bool = False
) -> Mapping[str, T]:
    """The entries of `files` that the copy in `ckpt_dir` should hold: all of them, but where the manifest records
    nodes and the directory's `node.json` names one of them, that node's (`held_by`); `subset` (a `step-N.subset/`
    directory): those its `subset.json` names. ManifestError when the node file is there but not a regular file of a
    node the manifest records, or a subset's file is missing or names a file the manifest does not."""
    if subset:
        where = str(Path(ckpt_dir) / SUBSET_FILE)
        raw = safefile.read_regular(where, where, MARKER_MAX_BYTES, error=ManifestError)
        return {rel: files[rel] for rel in parse_subset_file(raw, files, where)}
    path = Path(ckpt_dir) / NODE_FILE
    if nodes is None or not os.path.lexists(path):
        return files
    raw = safefile.read_regular(path, str(path), NODE_FILE_MAX_BYTES, error=ManifestError)
    node = parse_node_file(raw, nodes, str(path))
    return {rel: files[rel] for rel in held_by(files, nodes, node)}


def subset_file_bytes(rels: Iterable[str]) -> bytes:
    return json.dumps({"files": sorted(set(rels))}, separators=(",", ":")).encode()


def parse_subset_file(raw: bytes, files: Mapping[str, Any], where: str) -> list[str]:
    """The files a `subset.json` names, each one the manifest's `files` records, once; ManifestError otherwise."""
    obj = safefile.loads(raw, where, max_values=len(files) + 4, error=ManifestError)
    listed = obj.get("files") if isinstance(obj, dict) and set(obj) == {"files"} else None
    if not isinstance(listed, list) or len(set(map(str, listed))) != len(listed):
        raise ManifestError(f'{where}: must be an object naming each file it holds once ({{"files": [...]}})')
    for rel in listed:
        if not isinstance(rel, str) or rel not in files:
            raise ManifestError(f"{where}: names {rel!r:.120}, which the manifest does not")
    return sorted(listed)


def node_file_bytes(node: str) -> bytes:
    if not is_node_id(node):
        raise ValueError(f"{node!r:.80} is not a node id")
    return json.dumps({"node": node}).encode()


def parse_node_file(raw: bytes, nodes: Nodes | None, where: str) -> str:
    """The node a `node.json` names; ManifestError unless it is a node the manifest names."""
    obj = safefile.loads(raw, where, max_values=16, error=ManifestError)
    node = obj.get("node") if isinstance(obj, dict) else None
    if not is_node_id(node):
        raise ManifestError(f'{where}: must be an object naming a node id ({{"node": ...}})')
    assert isinstance(node, str)
    if nodes is None or node not in nodes:
        raise ManifestError(f"{where}: names node {node!r}, which the manifest does not record")
    return node


# --------------------------------------------------------------------------- markers in the durable tier


def marker_name(node: str) -> str:
    if not is_node_id(node):
        raise ValueError(f"{node!r:.80} is not a node id")
    return f"node-{node}.json"


def parse_marker_name(name: str) -> str | None:
    """The node of a marker object's name (`node-<id>.json`), None for any other name."""
    m = _MARKER.match(name)
    return m.group(1) if m else None


def marker_bytes(node: str, step: int, files: Mapping[str, Any]) -> bytes:
    """What `node` writes once its files are in the tier: the files it verified there, with their sizes and
    checksums (an entry's `size` and `checksum`)."""
    body = {
        "node": node,
        "step": step,
        "files": {rel: {"size": e.size, "checksum": e.checksum} for rel, e in sorted(files.items())},
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def parse_marker(raw: bytes, node: str, step: int, files: Mapping[str, Any] | None, where: str) -> list[str]:
    """The files a marker of `node` says it verified, each as the manifest's `files` records it; ManifestError
    naming what is wrong (another node, another step, a file the manifest does not name or names otherwise).
    `files` None (a step no manifest commits: its leftovers swept): each name need only be a safe relative path."""
    if len(raw) > MARKER_MAX_BYTES:
        raise ManifestError(f"{where}: {len(raw)} bytes, over the {MARKER_MAX_BYTES}-byte limit for a marker")
    obj = safefile.loads(raw, where, max_values=MARKER_MAX_BYTES // 16, error=ManifestError)
    if not isinstance(obj, dict) or obj.get("node") != node or obj.get("step") != step or type(step) is not int:
        raise ManifestError(f"{where}: not the marker of node {node!r} for step {step}")
    listed = obj.get("files")
    if not isinstance(listed, dict):
        raise ManifestError(f"{where}: files must be an object")
    for rel, entry in listed.items():
        if files is None:
            safefile.validate_relpath(rel)
            continue
        want = files.get(rel)
        if want is None:
            raise ManifestError(f"{where}: names {rel!r:.120}, which the manifest does not")
        if not isinstance(entry, dict) or entry.get("size") != want.size or entry.get("checksum") != want.checksum:
            raise ManifestError(f"{where}: records {rel!r:.120} other than the manifest does")
    return sorted(listed)


def missing_for_commit(
    files: Mapping[str, Any], nodes: Nodes, markers: Mapping[str, list[str]], sizes: Mapping[str, int]
) -> list[str]:
    """What a commit still waits for, empty when it may be made: every node the manifest names has its marker
    (listing the files it sends), and every file is in the tier at its recorded size (`sizes`: file -> size listed).
    Each reason names the node or the file."""
    waiting: list[str] = []
    for node in sorted(nodes):
        got = markers.get(node)
        if got is None:
            waiting.append(f"node {node}'s part (no marker yet)")
        elif not set(sent_by(files, nodes, node)) <= set(got):
            waiting.append(f"node {node}'s marker lists not every file of its ranks")
    for rel, entry in sorted(files.items()):
        size = sizes.get(rel)
        if size != entry.size:
            waiting.append(f"{rel} ({'missing' if size is None else f'{size} bytes, recorded {entry.size}'})")
            if len(waiting) >= 10:
                break
    return waiting
