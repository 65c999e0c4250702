"""What the two backends of the durable tier (`fs`, `s3`) share beyond the contract: their making from a location
and options, and ranged reads as pieces of one read.
"""

from __future__ import annotations

from abc import abstractmethod

from ftsup.store.durable.tier import (
    READ_PIECE_BYTES,
    DurableOptions,
    DurableTier,
    Location,
    PieceHook,
)


class Backend(DurableTier):
    """A backend: made from its location and options; both reads are `read_into`."""

    def __init__(self, location: Location, options: DurableOptions) -> None:
        self.location = location
        self.options = options

    def read_range(self, step: int, token: str, rel: str, offset: int, length: int) -> bytes:
        got: list[bytes] = []
        self.read_into(step, token, rel, offset, length, max(length, 1), lambda at, data: got.append(data))
        return got[0] if len(got) == 1 else b"".join(got)

    def read_pieces(self, step: int, token: str, rel: str, offset: int, length: int, each: PieceHook) -> None:
        self.read_into(step, token, rel, offset, length, READ_PIECE_BYTES, each)

    @abstractmethod
    def read_into(self, step: int, token: str, rel: str, offset: int, length: int, piece: int, each: PieceHook) -> None:
        """`length` bytes at `offset` of file `rel` of the checkpoint whose data is `token`, handed to `each` in
        pieces of `piece` bytes (the last may be shorter), in file order."""
