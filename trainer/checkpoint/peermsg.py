"""What crosses between nodes for the peer memories, read as hostile input: the peers each node's part goes to, the
offer header a peer sends before a part's files, and each file's check on arrival (trainer/checkpoint/DESIGN.md,
Peer memories). No torch, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from ftsup.store import checksums, layout, nodes, safefile
from ftsup.store.errors import CheckpointError

HEADER_BYTES = 64 << 10
"""An offer's fixed size on the wire: a peer can never make a node receive more before it has accepted."""
MAX_FILES = 256
"""The most files one offer may name (a rank sends three, a node's part three a rank)."""
VERSION = 1


class PeerError(CheckpointError):
    """A peer's message or file refused: its schema, its size, its checksum, its name (which peer, and why)."""


def reason_of(e: Exception) -> str:
    """A failure as one line for a transfer's error and the save's log: the message of an error the exchange
    expects (a check failing, I/O, gloo's RuntimeError), the type too of any other."""
    return str(e) if isinstance(e, (CheckpointError, OSError, RuntimeError)) else f"{type(e).__name__}: {e}"


def assign(domains: Mapping[str, str], replicas: int) -> dict[str, tuple[str, ...]]:
    """node -> the nodes holding its replicas: the next nodes after it in id order (a ring, so every node holds as
    many as it sends), skipping those of its own failure domain (`domains`: node -> its domain); fewer than
    `replicas` where not enough other domains exist."""
    order = sorted(domains)
    out: dict[str, tuple[str, ...]] = {}
    for i, node in enumerate(order):
        picked: list[str] = []
        for j in range(1, len(order)):
            other = order[(i + j) % len(order)]
            if len(picked) < replicas and domains[other] != domains[node]:
                picked.append(other)
        out[node] = tuple(picked)
    return out


def rank_files(manifest: layout.Manifest, ranks: Iterable[int]) -> list[str]:
    """The files of `manifest` that belong to `ranks` (shards, block checksums, rank states), sorted."""
    wanted = set(ranks)
    return sorted(rel for rel in manifest.files if nodes.rank_of(rel) in wanted)


def offer(step: int, node: str, rels: Iterable[str], manifest: layout.Manifest) -> bytes:
    """The header a peer sends before the files `rels` of `node`'s part of checkpoint `step`, padded to
    HEADER_BYTES."""
    body = {"v": VERSION, "step": step, "node": node, "files": {r: manifest.files[r].size for r in sorted(rels)}}
    raw = json.dumps(body, separators=(",", ":")).encode()
    if len(raw) > HEADER_BYTES:
        raise PeerError(f"an offer of {len(raw)} bytes is more than {HEADER_BYTES}")
    return raw + b" " * (HEADER_BYTES - len(raw))


def check_offer(raw: bytes, manifest: layout.Manifest, step: int, node: str, expected: Iterable[str]) -> list[str]:
    """The files an offer from a peer names, once it says what this node expects: the version, checkpoint `step`,
    `node`'s part, exactly the files `expected` (names of the manifest this node holds), each at the manifest's
    size; PeerError naming what is wrong otherwise."""
    where = f"a peer's offer of node {node!r}'s part of step {step}"
    if len(raw) != HEADER_BYTES:
        raise PeerError(f"{where}: {len(raw)} bytes, not {HEADER_BYTES}")
    try:
        body = safefile.loads(bytes(raw).rstrip(b" "), where, max_values=4 * MAX_FILES, error=PeerError)
    except CheckpointError as e:
        raise PeerError(str(e)) from None
    if not isinstance(body, dict) or set(body) != {"v", "step", "node", "files"}:
        raise PeerError(f"{where}: not an object of v, step, node and files")
    if body["v"] != VERSION or type(body["step"]) is not int or body["step"] != step or body["node"] != node:
        shown = {k: body[k] for k in ("v", "step", "node")}
        raise PeerError(f"{where}: it offers {json.dumps(shown)[:200]}, not version {VERSION} of that part")
    files = body["files"]
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise PeerError(f"{where}: files must be an object of at most {MAX_FILES} names")
    for rel, size in files.items():
        try:
            safefile.validate_relpath(rel)
        except CheckpointError as e:
            raise PeerError(f"{where}: {e}") from None
        entry = manifest.files.get(rel)
        if entry is None or type(size) is not int or size != entry.size:
            recorded = "none" if entry is None else f"{entry.size} bytes"
            raise PeerError(f"{where}: {rel!r:.80} of {size!r:.40} bytes (the manifest records {recorded})")
    want = sorted(expected)
    if sorted(files) != want:
        raise PeerError(f"{where}: it names {sorted(files)[:6]}, not the part's files {want[:6]}")
    return want


def check_file(rel: str, data: bytes | bytearray | memoryview, manifest: layout.Manifest, peer: str) -> None:
    """A file received from `peer`: its size and checksum are the manifest's; PeerError otherwise."""
    entry = manifest.files[rel]
    if len(data) != entry.size or not checksums.checksum_matches(data, entry.checksum):
        raise PeerError(f"{rel} received from {peer}: checksum mismatch (a torn or corrupt copy); not kept")
