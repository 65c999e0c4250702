"""The model configuration a checkpoint records, in the one form that always matches itself (`canonical`), and the
keys two of them differ in (`differences`; docs/design/trainer.md, The training state and its configuration).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from typing import Any, cast

SOFTWARE_KEYS = frozenset({"transformers_version", "ftsup_version", "torch_version"})
"""Keys (at any depth) that name the software that wrote a configuration, not the model."""

MAX_DEPTH = 32  # deeper than any model configuration; a cycle or a runaway structure ends here
MAX_REPORTED = 10  # differences named in one refusal; the rest are counted
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


class ConfigError(TypeError):
    """A configuration that cannot be recorded: a value JSON has no form for, or two keys that JSON
    would merge into one. Raised when the run starts, never at a save."""


def canonical(config: Any) -> dict[str, Any]:
    """`config` as JSON reads it back: a mapping, an object with `to_dict()` (a `PretrainedConfig`)
    or a dataclass instance; None is the empty configuration. ConfigError names the key path of
    anything that has no JSON form."""
    if config is None:
        return {}
    value = _plain(config, "config")
    if not isinstance(value, Mapping):
        raise ConfigError(f"config must be a mapping, a dataclass or have to_dict(), not {type(config).__name__}")
    return cast(dict[str, Any], _canonical(value, "config", 0))


def is_software_key(key: str) -> bool:
    return key in SOFTWARE_KEYS or key.startswith("_")


def differences(saved: Any, mine: Any, path: str = "config") -> list[tuple[str, Any, Any]]:
    """(key path, checkpoint's value, this run's value) for every key whose values differ, software
    keys left out. Both sides are canonical (this run's) or read from JSON (the checkpoint's)."""
    if isinstance(saved, Mapping) and isinstance(mine, Mapping):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(saved) | set(mine), key=str):
            if is_software_key(str(key)):
                continue
            out += differences(saved.get(key, _MISSING), mine.get(key, _MISSING), f"{path}.{key}")
        return out
    if _equal(saved, mine):
        return []
    return [(path, saved, mine)]


def describe(diffs: list[tuple[str, Any, Any]]) -> list[str]:
    """One line per difference (at most MAX_REPORTED, then a count of the rest)."""
    lines = [f"{p}: checkpoint {_show(a)} != this run {_show(b)}" for p, a, b in diffs[:MAX_REPORTED]]
    if len(diffs) > MAX_REPORTED:
        lines.append(f"config: {len(diffs) - MAX_REPORTED} more keys differ")
    return lines


# ---------------------------------------------------------------------- internals


class _Missing:
    def __repr__(self) -> str:
        return "(no such key)"


_MISSING = _Missing()


def _plain(value: Any, path: str) -> Any:
    """A configuration object as the mapping it stands for; anything else unchanged."""
    if isinstance(value, Mapping):
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        try:
            return to_dict()
        except Exception as e:  # a user's object: say which one failed, and how
            raise ConfigError(f"{path}: {type(value).__name__}.to_dict() failed: {e!r}") from e
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


def _canonical(value: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ConfigError(f"{path}: nested more than {MAX_DEPTH} levels deep (a cycle?)")
    value = _plain(value, path)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # the string JSON writes for a str subclass (a str-valued enum)
    if isinstance(value, int):
        return int(value)  # an IntEnum or a numpy-free int subclass becomes the int JSON writes
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"  # NaN != NaN: as a string it matches itself after a round trip
        return _NON_FINITE.get(value, float(value))
    if isinstance(value, enum.Enum):
        return _canonical(value.value, path, depth + 1)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        origin: dict[str, Any] = {}
        for key, item in value.items():
            name = _key(key, path)
            if name in out:
                raise ConfigError(f"{path}: keys {origin[name]!r} and {key!r} are both {name!r} in JSON; keep one")
            origin[name] = key
            out[name] = _canonical(item, f"{path}.{name}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    item = getattr(value, "item", None)  # a numpy scalar or a 0-d tensor
    if callable(item) and getattr(value, "ndim", None) == 0:
        return _canonical(item(), path, depth + 1)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")  # as transformers writes a dtype in config.json
    raise ConfigError(
        f"{path}: a value of type {type(value).__name__} has no JSON form; give the configuration as "
        "numbers, strings, booleans, lists and mappings (or convert this value yourself)"
    )


def _key(key: Any, path: str) -> str:
    """A mapping key as json.dumps writes it: 1 as "1", 1.5 as "1.5", True as "true", None as "null"."""
    if isinstance(key, str):
        return str.__str__(key)
    if key is None or isinstance(key, bool):
        return json.dumps(key)
    if isinstance(key, int):
        return str(int(key))
    if isinstance(key, float):
        return json.dumps(key)  # repr, or NaN / Infinity / -Infinity
    raise ConfigError(f"{path}: a key of type {type(key).__name__} ({key!r:.40}) has no JSON form")


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b) and not (_number(a) and _number(b)):
        return False
    return bool(a == b)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
