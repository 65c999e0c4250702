"""A load's plan at thousands of ranks: rank 0's checked DCP metadata packed by tensor (`pack`), each rank's own
tensors' chunks unpacked (`unpack`; trainer/checkpoint/DESIGN.md, "Loading at thousands of ranks").
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from typing import Any

Row = tuple[tuple[int, ...], tuple[int, ...], str, str, int]
"""One saved chunk: (offsets, sizes, file, crc_file, byte_offset)."""


def pack(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0: the checked `meta` (`dcpmeta.read`) as it is broadcast: {"tensors": {fqn: {"dtype", "size"}},
    "skeleton", "chunks": {fqn: packed rows}}."""
    tensors = {fqn: {"dtype": t["dtype"], "size": t["size"]} for fqn, t in meta["tensors"].items()}
    chunks = {fqn: pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for fqn, r in rows(meta).items()}
    return {"tensors": tensors, "skeleton": meta["skeleton"], "chunks": chunks}


def rows(meta: Mapping[str, Any]) -> dict[str, list[Row]]:
    """Every tensor's saved chunks in the checked `meta`, in the order its tensor declares them (`dcpmeta` checked
    that every declared chunk is stored, once)."""
    stored: dict[tuple[str, tuple[int, ...]], Mapping[str, Any]] = {}
    for s in meta["storage"]:
        stored[(s["fqn"], tuple(s["offsets"]))] = s
    out: dict[str, list[Row]] = {}
    for fqn, t in meta["tensors"].items():
        mine: list[Row] = []
        for c in t["chunks"]:
            offsets = tuple(c["offsets"])
            s = stored[(fqn, offsets)]
            mine.append((offsets, tuple(s["sizes"]), s["file"], s["crc_file"], s["byte_offset"]))
        out[fqn] = mine
    return out


def unpack(packed: Mapping[str, Any], names: Iterable[str]) -> dict[str, list[Row]]:
    """The saved chunks of the tensors `names` (those the checkpoint holds), from `pack`'s output: what crossed
    ranks is rank 0's pickle of checked metadata, like the object collectives' own."""
    chunks = packed["chunks"]
    return {fqn: pickle.loads(chunks[fqn]) for fqn in names if fqn in chunks}
