"""The Hugging Face Hub's layout of a model's weights: shard sizes, the split, names, the index, and a model
directory read header by header as hostile input.

Stdlib only (ftsup/store/DESIGN.md, Hugging Face files). Not here: the safetensors header (`stheader`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftsup.store import safefile, stheader
from ftsup.store.errors import CheckpointError, ModelFileError

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
TRAINER_FORMAT = "hf-trainer"
"""The manifest metadata's `format` of a checkpoint `FtsupCallback` committed: a Trainer's `checkpoint-N/`,
whose weights are in this layout (`save_pretrained`'s)."""
INDEX_MAX_BYTES = 64 << 20  # one line per tensor: huggingface_hub refuses past 10 MiB
CONFIG_MAX_BYTES = 16 << 20  # a model config is a few KiB; tokenizer-sized vocabularies stay far below this
MAX_FILES = 100_000  # the names have five digits
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # huggingface_hub's MAX_SHARD_SIZE, "5GB"

_DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BINARY = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """A size as the Hub's tools read `max_shard_size`: digits alone are bytes; a number with KB, MB, GB
    or TB is in powers of 10 (huggingface_hub's `parse_size_to_int`, transformers'
    `convert_file_size_to_int`), with KiB, MiB, GiB or TiB in powers of 2 (transformers'), in any case.
    Refused, with a ValueError that says why: a decimal unit ending in a lowercase b (transformers
    reads `5Gb` as gigabits, huggingface_hub as gigabytes), a bare B (`7B` reads as a count), anything
    else, and a size under 1 byte."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (a number of bytes, or with a unit: 5GB, 500MB, 2GiB)")
    number, unit = m.group(1), m.group(2)
    if unit and unit.upper() in _DECIMAL and unit.endswith("b"):
        raise ValueError(
            f"{text!r} is ambiguous: transformers reads {unit} as bits and huggingface_hub as bytes; "
            f"write {unit[:-1].upper()}B"
        )
    if unit and unit.upper() not in _DECIMAL and unit.upper() not in _BINARY:
        raise ValueError(f"not a size: {text!r} (units: KB, MB, GB, TB, KiB, MiB, GiB, TiB; digits alone are bytes)")
    if not unit and not number.isdigit():
        raise ValueError(f"not a size: {text!r} (a number of bytes is an integer)")
    size = int(number) if not unit else int(float(number) * {**_DECIMAL, **_BINARY}[unit.upper()])
    if size < 1:
        raise ValueError(f"{text!r}: a shard must hold at least 1 byte")
    return size


def plan_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """The shards of (name, bytes) tensors, as huggingface_hub splits a state dict: in the given order,
    each tensor into the current shard until the next would pass `max_bytes`; a tensor larger than that
    alone in a shard of its own, added when it is met (the current shard goes on filling)."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, n in sizes:
        if n > max_bytes:
            shards.append([name])
            continue
        if size + n > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


def shard_names(n: int) -> list[str]:
    """The files of a model in `n` shards: one `model.safetensors`, or `model-0000k-of-0000n.safetensors`."""
    return [SINGLE_NAME] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


def index_bytes(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """`model.safetensors.index.json` as huggingface_hub's `save_torch_state_dict` writes it."""
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}, indent=2).encode()


@dataclass(frozen=True)
class HubModel:
    """A Hub-layout model directory as its headers describe it."""

    root: Path
    index: dict[str, Any] | None  # the index's `metadata` (None: a single model.safetensors)
    headers: dict[str, stheader.Header]  # by file name, in the order the index first names them
    weight_map: dict[str, str]  # tensor -> file, in the index's order (a single file's: its header's)
    follow_links: bool = True

    def path(self, file: str) -> Path:
        """What to open to read `file`'s bytes: the file whose header was read."""
        return _target(self.root, file, self.follow_links)

    @property
    def tensors(self) -> dict[str, stheader.TensorEntry]:
        return {name: self.headers[file].tensors[name] for name, file in self.weight_map.items()}

    @property
    def header_bytes(self) -> int:
        """The bytes `read` read of the weights: each file's 8-byte length and header."""
        return sum(h.data_start for h in self.headers.values())


def is_hub_dir(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return os.path.lexists(p / SINGLE_NAME) or os.path.lexists(p / INDEX_NAME)


def read(path: str | os.PathLike[str], *, follow_links: bool = True) -> HubModel:
    """The model in directory `path`: `model.safetensors` (taken first, as transformers does) or
    `model.safetensors.index.json` and the files it names. Raises ModelFileError naming the file and
    the tensor. `follow_links`: a link to a regular file is followed (a directory the caller names is
    theirs, and the Hub's cache links its files to blobs); False in a checkpoint store, which never does."""
    root = Path(path)
    if not root.is_dir():
        raise ModelFileError(f"{root}: not a directory")
    if os.path.lexists(root / SINGLE_NAME):
        header = _header(root, SINGLE_NAME, follow_links)
        return HubModel(root, None, {SINGLE_NAME: header}, dict.fromkeys(header.tensors, SINGLE_NAME), follow_links)
    if not os.path.lexists(root / INDEX_NAME):
        raise ModelFileError(f"{root}: holds neither {SINGLE_NAME} nor {INDEX_NAME}; not a Hugging Face model")
    what = str(root / INDEX_NAME)
    index = _read_json(root, INDEX_NAME, INDEX_MAX_BYTES, follow_links)
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ModelFileError(f"{what}: not a JSON object with a weight_map object")
    meta = index.get("metadata", {})
    if not isinstance(meta, dict):
        raise ModelFileError(f"{what}: metadata is not an object")
    weight_map: dict[str, str] = index["weight_map"]
    first: dict[str, str] = {}  # file -> the first tensor the index puts in it
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ModelFileError(f"{what}: tensor {name!r:.200} maps to {file!r:.80}, not a file name")
        first.setdefault(file, name)
    if len(first) > MAX_FILES:
        raise ModelFileError(f"{what}: names {len(first)} files, more than {MAX_FILES}")
    for file, name in first.items():
        if not _safe_name(file):
            raise ModelFileError(
                f"{what}: names the file {file!r:.200} (for tensor {name!r:.200}), which is not a "
                "relative path of a .safetensors file inside the directory"
            )
        if not os.path.lexists(root / file):
            raise ModelFileError(f"{what}: names {file} (for tensor {name!r:.200}), which is missing")
    headers = {file: _header(root, file, follow_links) for file in first}
    for name, file in weight_map.items():
        if name not in headers[file].tensors:
            raise ModelFileError(f"{what}: puts tensor {name!r:.200} in {file}, whose header has no such tensor")
    for file, header in headers.items():
        for name in header.tensors:
            if weight_map.get(name) != file:
                elsewhere = f"puts it in {weight_map[name]}" if name in weight_map else "does not list it"
                raise ModelFileError(f"{root / file}: holds tensor {name!r:.200}, but {INDEX_NAME} {elsewhere}")
    return HubModel(root, meta, headers, weight_map, follow_links)


def read_config(path: str | os.PathLike[str], *, follow_links: bool = True) -> dict[str, Any] | None:
    """`config.json` beside a model's weights (None when there is none): a JSON object, capped."""
    root = Path(path)
    if not os.path.lexists(root / CONFIG_NAME):
        return None
    what = str(root / CONFIG_NAME)
    config = _read_json(root, CONFIG_NAME, CONFIG_MAX_BYTES, follow_links)
    if not isinstance(config, dict):
        raise ModelFileError(f"{what}: a model config is a JSON object, not {type(config).__name__}")
    return config


def _safe_name(file: str) -> bool:
    try:
        safefile.validate_relpath(file)
    except CheckpointError:
        return False
    return file.endswith(".safetensors") and len(file) <= 4096


def _read_json(root: Path, rel: str, max_bytes: int, follow_links: bool) -> Any:
    """The JSON of the file `rel` in `root`, at most `max_bytes` (and a value per 8 of them); ModelFileError."""
    return safefile.read_json(
        _target(root, rel, follow_links), str(root / rel), max_bytes, max_values=max_bytes // 8, error=ModelFileError
    )


def _target(root: Path, rel: str, follow_links: bool) -> Path:
    """The path to open: with `follow_links`, the file a link names (opened then without following
    one more); without, the name itself, inside `root` (a link is then refused by the open)."""
    if follow_links:
        return (root / rel).resolve()
    if os.path.islink(root / rel):
        raise ModelFileError(f"{root / rel}: is a symbolic link; refusing to follow it")
    try:
        safefile.resolve_inside(root, rel)
    except CheckpointError as e:
        raise ModelFileError(str(e)) from None
    return root / rel


def _header(root: Path, file: str, follow_links: bool) -> stheader.Header:
    return stheader.read(_target(root, file, follow_links), str(root / file), error=ModelFileError)
