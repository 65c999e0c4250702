"""Data skips: half-open ranges of global data positions that no rank serves, checked, and as the environment
carries them (DESIGN.md, Training health). Stdlib only; `ftsup.protocol` re-exports them beside the variable.
"""

from __future__ import annotations

MAX_DATA_SKIPS = 64
MAX_DATA_POSITION = 2**53  # a data position travels exactly as a JSON number and as a heartbeat figure
_MAX_DATA_SKIPS_CHARS = MAX_DATA_SKIPS * 34  # 64 ranges of two 16-digit positions, a colon and a comma each

DataSkips = tuple[tuple[int, int], ...]
"""Half-open ranges [A, B) of global data positions that a schedule never serves, sorted and not
overlapping (two may touch), at most MAX_DATA_SKIPS of them."""


def check_data_skips(value: object, what: str) -> DataSkips:
    """`value` (pairs, as JSON reads them: lists of two integers) as DataSkips; ValueError naming
    `what` when it is anything else: not integers, 0 <= A < B <= MAX_DATA_POSITION, unsorted or
    overlapping, more than MAX_DATA_SKIPS ranges."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list of [A, B] ranges, not {value!r:.60}")
    if len(value) > MAX_DATA_SKIPS:
        raise ValueError(f"{what} holds {len(value)} ranges, more than {MAX_DATA_SKIPS}")
    out: list[tuple[int, int]] = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or any(type(x) is not int for x in item):
            raise ValueError(f"{what}: {item!r:.60} is not a range [A, B] of two integers")
        a, b = item
        if not 0 <= a < b <= MAX_DATA_POSITION:
            raise ValueError(f"{what}: range [{a}, {b}) is not 0 <= A < B <= {MAX_DATA_POSITION}")
        if out and a < out[-1][1]:
            raise ValueError(f"{what}: range [{a}, {b}) is out of order or overlaps [{out[-1][0]}, {out[-1][1]})")
        out.append((a, b))
    return tuple(out)


def parse_data_skips(raw: str, name: str = "data skips") -> DataSkips:
    """`A:B,C:D` (`ftsup.protocol.DATA_SKIPS_ENV`'s format; empty: none) as DataSkips; ValueError naming `name`."""
    text = raw.strip()
    if not text:
        return ()
    if len(text) > _MAX_DATA_SKIPS_CHARS:
        raise ValueError(f"{name} is {len(text)} characters long, more than {MAX_DATA_SKIPS} ranges need")
    pairs = []
    for part in text.split(","):
        a, sep, b = part.partition(":")
        if not sep or not all(x.isascii() and x.isdigit() and len(x) <= 16 for x in (a, b)):
            raise ValueError(f"{name}={text[:80]!r}: {part[:40]!r} is not a range A:B of two non-negative integers")
        pairs.append((int(a), int(b)))
    return check_data_skips(pairs, f"{name}={text[:80]!r}")


def encode_data_skips(skips: DataSkips) -> str:
    """DataSkips as the environment carries them (`parse_data_skips` reads them back)."""
    return ",".join(f"{a}:{b}" for a, b in check_data_skips(skips, "data skips"))
