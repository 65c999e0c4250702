"""Shared test helpers: fake checkpoint stores built with the real manifest code, no torch.

A fake checkpoint is laid out exactly as the commit protocol leaves it (files, then
`manifest.json` written last, then the directory under its final name), so tests of the
reader, the CLI and the supervisor see what a real save produces, minus the tensors.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ftsup.store import checksums, durable, layout


def make_fake_checkpoint(
    root: str | Path,
    step: int,
    files: Mapping[str, bytes],
    *,
    kind: str = "periodic",
    world_size: int = 2,
    created_unix: float = 1_700_000_000.0,
    metadata: Mapping[str, Any] | None = None,
    partial: bool = False,
    manifest: bool = True,
) -> Path:
    """Write `files` and a manifest recording them under `root`; return the checkpoint dir.

    `partial=True` leaves it as `step-N.partial` (a save in progress or torn);
    `manifest=False` leaves the manifest out (a commit that never happened).
    """
    root = Path(root)
    name = layout.partial_dirname(step) if partial else layout.step_dirname(step)
    ckpt = root / name
    ckpt.mkdir(parents=True)
    entries = {}
    for rel, data in files.items():
        path = ckpt / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        entries[rel] = layout.FileEntry(size=len(data), checksum=checksums.checksum_bytes(data))
    if manifest:
        m = layout.Manifest(
            step=step,
            world_size=world_size,
            kind=kind,
            created_unix=created_unix,
            files=entries,
            tensor_bytes=sum(len(d) for d in files.values()),
            metadata=dict(metadata or {}),
        )
        layout.write_json_atomic(ckpt / layout.MANIFEST_NAME, m.to_json())
    return ckpt


def default_files(seed: int = 0) -> dict[str, bytes]:
    """Two small shards and per-rank state, distinct per `seed`, one shard spanning 2 blocks."""
    block = layout.CHECKSUM_BLOCK_BYTES
    return {
        "shard-00000.safetensors": bytes((seed + i) % 251 for i in range(block + 100)),
        "shard-00001.safetensors": bytes((seed * 7 + i) % 241 for i in range(1000)),
        "rank-00000/state.json": b'{"rank": 0}',
    }


def flip_byte(path: str | Path, offset: int = 0) -> None:
    """Invert one byte in place: same size, different content (only a deep check sees it)."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def write_manifest_json(ckpt: str | Path, obj: Mapping[str, Any]) -> None:
    """Overwrite a checkpoint's manifest with raw JSON (for malformed-manifest tests)."""
    layout.write_json_atomic(Path(ckpt) / layout.MANIFEST_NAME, dict(obj))


def torn_newest(root: Path) -> Path:
    """A store under `root` with a consistent checkpoint of step 100 and a torn one of step 200 (a shard's bytes
    replaced): the one a resume choice quarantines. Returns step 200's directory."""
    make_fake_checkpoint(root, 100, default_files(1))
    torn = make_fake_checkpoint(root, 200, default_files(2))
    (torn / "shard-00000.safetensors").write_bytes(b"torn")
    return torn


def slow_choices(monkeypatch: Any, wait_s: float = 30.0) -> Any:
    """Make every resume choice of `ftsup.store.choice` wait until the returned event is set (a store slow to
    answer, then answering as itself)."""
    import threading

    from ftsup.store import choice

    release, real = threading.Event(), choice.choose

    def slow(*args: Any, **kw: Any) -> choice.Choice:
        release.wait(wait_s)
        return real(*args, **kw)

    monkeypatch.setattr(choice, "choose", slow)
    return release


def read_back_in_pieces(tier: durable.DurableTier, step: int) -> dict[str, list[tuple[int, bytes]]]:
    """Every file of the committed checkpoint `step` of the durable tier `tier` read back by `read_files`: the
    (offset, bytes) pieces its `write` was handed, per file in file order. Fails the test on any problem found."""
    got: dict[str, list[tuple[int, bytes]]] = {}
    lock = threading.Lock()

    def write(rel: str, offset: int, data: bytes) -> None:
        with lock:
            got.setdefault(rel, []).append((offset, bytes(data)))

    manifest, raw = tier.manifest(step)
    assert tier.read_files(step, durable.data_token(raw), manifest, write) == []
    return {rel: sorted(pieces) for rel, pieces in got.items()}


def assert_whole_pieces(pieces: dict[str, list[tuple[int, bytes]]], files: Mapping[str, bytes]) -> None:
    """`pieces` (read_back_in_pieces) hold exactly `files`, each piece READ_PIECE_BYTES but the last of its ranged
    read (READ_CHUNK_BYTES), so that the block checksums of each piece are the file's."""
    assert sorted(pieces) == sorted(rel for rel, data in files.items() if data)
    for rel, data in files.items():
        if not data:
            continue
        assert b"".join(piece for _, piece in pieces[rel]) == data, rel
        for offset, piece in pieces[rel]:
            range_end = min(len(data), (offset // durable.READ_CHUNK_BYTES + 1) * durable.READ_CHUNK_BYTES)
            assert len(piece) == min(durable.READ_PIECE_BYTES, range_end - offset), (rel, offset, len(piece))


def node_read_events(text: str) -> list[dict[str, Any]]:
    """Every `checkpoint_node_read` event in the ranks' log output `text`: rank, files read from the node's own copy
    and from the durable tier, the checkpoint's path. Ranks share one pipe, so one rank's line may come with another's
    appended before its own newline: each event is read from its name on, each field at its first mention (the
    event's own, which come before anything appended)."""
    found = []
    for line in text.splitlines():
        for event in line.split("checkpoint_node_read")[1:]:
            fields: dict[str, Any] = {}
            for k, v in re.findall(r'"?(rank|local_files|durable_files)"?[=:] ?(\d+)', event):
                fields.setdefault(k, int(v))
            where = re.search(r'"?path"?[=:] ?"?([^",\s]+)', event)
            found.append(fields | {"path": where.group(1) if where else ""})
    return found


def mounted_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's notation: "8m") at the new directory `where`, for a fixture to yield from; the test
    is skipped where it cannot be mounted (not root). Unmounted lazily afterwards."""
    where.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]).returncode
    ):
        pytest.skip("mounting a size-limited tmpfs needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
