"""Hostile Hugging Face model files for tests: a safetensors header rewritten to lie about its tensors' bytes.

`rewrite_header(path, change)` rewrites a safetensors file with its header's JSON changed by `change` and its data
bytes as they were; `overlap` and `past_end` are such changes; `with_two_tensors(dir)` finds a shard that has two
tensors to overlap.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Header = dict[str, Any]


def rewrite_header(path: Path, change: Callable[[Header], None]) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def _by_offset(header: Header) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def overlap(header: Header) -> None:
    """The second tensor's bytes moved 4 bytes back, onto the first's."""
    second = header[_by_offset(header)[1]]
    second["data_offsets"] = [o - 4 for o in second["data_offsets"]]


def past_end(header: Header) -> None:
    """The last tensor's bytes moved 8 bytes on, past the end of the file."""
    last = header[_by_offset(header)[-1]]
    last["data_offsets"] = [o + 8 for o in last["data_offsets"]]


def with_two_tensors(directory: Path, pattern: str = "model-*.safetensors") -> Path:
    """The first shard (by name) of `directory` whose header holds at least two tensors."""
    for path in sorted(directory.glob(pattern)):
        raw = path.read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        if len(_by_offset(header)) >= 2:
            return path
    raise AssertionError(f"no shard of {directory} holds two tensors")
