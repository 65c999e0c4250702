"""The job config file: read safely, parsed as YAML with bounds, or one `ConfigError` line naming the file.

`read_text` and `load_yaml`; what they refuse and why: docs/design/config.md, Reading the file.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from ftsup.store.errors import os_words
from ftsup.supervisor.config.values import Word, file_kind
from ftsup.supervisor.errors import ConfigError

MAX_CONFIG_BYTES = 256 * 1024  # a job config is a few kilobytes
MAX_YAML_DEPTH = 32  # a job config nests 4 levels (section, key, list or mapping, item)
MAX_YAML_ALIASES = 64


# --------------------------------------------------------------------------- the file


def read_text(source: str, path: Path, *, example: str) -> str:
    """The config file's text, else one `ConfigError` line (`example` is shown as what to pass instead)."""
    try:
        # Look before opening: opening a FIFO waits for a writer and opening some devices has side effects.
        kind = _not_regular(os.stat(path).st_mode)
        if kind is None:
            # O_NONBLOCK: if the path became a FIFO since the stat, the open returns at once instead of waiting.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                kind = _not_regular(st.st_mode)
                data = b"" if kind is not None or st.st_size > MAX_CONFIG_BYTES else _read_at_most(fd)
                size = max(st.st_size, len(data))
            finally:
                os.close(fd)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file; pass the path of a job config (example: {example})") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read it: {os_words(e)}") from None
    if kind is not None:
        raise ConfigError(
            f"{source}: is {kind}, not a regular file; pass the path of a job config (example: {example})"
        )
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source}: is {size} bytes; a job config is at most {MAX_CONFIG_BYTES // 1024} KiB (example: {example})"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text (bad byte at offset {e.start}); save it as UTF-8") from None


def _not_regular(mode: int) -> str | None:
    """None for a regular file, else what it is."""
    return None if stat.S_ISREG(mode) else file_kind(mode)


def _read_at_most(fd: int) -> bytes:
    """Up to MAX_CONFIG_BYTES + 1 bytes (one more shows that a file grew past the cap after its fstat)."""
    chunks: list[bytes] = []
    left = MAX_CONFIG_BYTES + 1
    while left > 0 and (chunk := os.read(fd, min(left, 65536))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships without type hints
    """SafeLoader without base-60 numbers and with duplicate keys refused."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                ident = (key_node.tag, key_node.value)
                if ident in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key_node.value!r} is given twice; keep one", key_node.start_mark
                    )
                seen.add(ident)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> Any:
        # Python refuses to convert integers past 4300 digits (a ValueError, not a YAML error). A shorter one
        # reaches its setting, which names the key and its bounds.
        if isinstance(node.value, str) and len(node.value) > 4000:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value)} characters is too large for any setting", node.start_mark
            )
        return super().construct_yaml_int(node)

    def construct_yaml_bool(self, node: Any) -> Any:
        word = self.construct_scalar(node)
        return word.lower() == "true" if word.lower() in ("true", "false") else Word(word)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:bool", _Loader.construct_yaml_bool)


_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# PyYAML's own patterns minus the sexagesimal (`1:2` = 62) forms; floats as in YAML 1.2, so `1e3` is a number.
# Order matters: the first matching resolver wins, so integers are tried before floats.
_Loader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9_]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def load_yaml(text: str, source: str) -> object:
    """The YAML document in `text` (None when empty), or a `ConfigError` naming `source` and the line and column.

    The document is first read as a stream of events, which PyYAML parses without recursion, and refused when it
    nests deeper than `MAX_YAML_DEPTH` (building the nodes of a 5000-deep list would exhaust Python's stack) or
    holds more than `MAX_YAML_ALIASES` aliases (each alias may stand for a whole tree: nine levels of nine aliases
    are a billion-item document, "billion laughs", to any code that walks it).
    """
    try:
        _check_shape(text, source)
        return yaml.load(text, Loader=_Loader)  # safe: _Loader is a SafeLoader
    except RecursionError:  # not expected after _check_shape; kept so that no input can give a traceback
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        detail = e.problem or "cannot parse"
        if e.context:
            at = f" at line {e.context_mark.line + 1}" if e.context_mark is not None and e.problem_mark else ""
            detail += f" ({e.context}{at})"
        raise ConfigError(f"{source}: {where}invalid YAML: {detail}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {' '.join(str(e).split())}") from None


def _check_shape(text: str, source: str) -> None:
    depth = aliases = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise ConfigError(
                    f"{source}: {_line(event)}nested more than {MAX_YAML_DEPTH} levels deep; a job config needs 4"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_YAML_ALIASES:
                raise ConfigError(
                    f"{source}: {_line(event)}more than {MAX_YAML_ALIASES} aliases (*name); write the values out"
                )


def _line(event: yaml.Event) -> str:
    mark = event.start_mark
    return "" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: "
