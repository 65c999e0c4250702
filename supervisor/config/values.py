"""Config values: raw YAML values turned into typed values, or one `ConfigError` naming the key path and the fix.

The building blocks of `config.job`: `Where`, `Section`, the parse functions, `plain_dataclass`. No I/O
(docs/design/config.md, Values).
"""

from __future__ import annotations

import difflib
import enum
import math
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, overload
from urllib.parse import urlsplit

from ftsup.supervisor.errors import ConfigError

# Ids name files, the rendezvous and FTSUP_RUN_ID: keep them to characters that are safe in all three, and short
# (64 is the longest hostname Linux allows, and the hostname is the default node id).
ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
MAX_ID_CHARS = 64
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Bounds on what a config may hold. A job config is a few kilobytes; these only stop a hostile or broken file
# from costing memory or time, or from failing later at exec (the kernel caps one argument at 128 KiB and the
# argument list plus the environment at 2 MiB; a NUL cannot be passed at all).
MAX_STRING_CHARS = 4096  # paths (PATH_MAX), URLs, names
MAX_ARG_CHARS = 32_768
MAX_ARGS = 1024
MAX_ARGV_CHARS = 262_144
MAX_ENV_VARS = 1024
MAX_SECONDS = 1e8  # about three years: longer is a typo, and some waits cannot take more (threading.TIMEOUT_MAX)
MAX_NPROC_PER_NODE = 4096
MAX_NODES = 100_000
PROVIDERS = ("aws", "gcp", "azure")
# torchrun flags that ftsup derives from the config; passing them again would contradict it.
_TORCHRUN_OWNED = {
    "nnodes": "launch.nnodes",
    "nproc-per-node": "launch.nproc_per_node",
    "max-restarts": "restart.max_restarts (restarts are ftsup's decision; torchrun always gets 0)",
    "rdzv-backend": "nothing (ftsup always uses c10d)",
    "rdzv-endpoint": "launch.rdzv_endpoint",
    "rdzv-id": "launch.rdzv_id",
    "standalone": "nothing (leave launch.rdzv_endpoint unset for a single node)",
}


# --------------------------------------------------------------------------- where errors point, sections


@dataclass(frozen=True)
class Where:
    """A key path inside a source, for error messages: `job.yaml: restart.window_s: ...`."""

    source: str
    path: str = ""
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Where the value of a key ("section.key") came from when not from `source`: a command-line flag."""

    def child(self, key: str) -> Where:
        return Where(self.source, f"{self.path}.{key}" if self.path else key, self.origins)

    def item(self, index: int) -> Where:
        return Where(self.source, f"{self.path}[{index}]", self.origins)

    def fail(self, message: str) -> NoReturn:
        source = self.origins.get(".".join(self.path.partition("[")[0].split(".")[:2]), self.source)
        raise ConfigError(f"{source}: {self.path}: {message}" if self.path else f"{source}: {message}")


_T = TypeVar("_T")
_D = TypeVar("_D")
Parse = Callable[[object, Where], _T]


class Section:
    """One YAML section, read into the fields of the dataclass `cls`: its keys (the field names) checked on
    construction, its values read through parse functions."""

    def __init__(self, where: Where, raw: object, cls: type) -> None:
        keys = field_names(cls)
        if raw is None:  # `metrics:` with nothing under it: all defaults
            raw = {}
        if not isinstance(raw, Mapping):
            where.fail(f"expected a mapping with keys such as {', '.join(keys[:3])}, got {describe(raw)}")
        check_keys(where, raw, keys, noun="key")
        self.where = where
        self._raw = raw
        self._defaults = {
            f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(cls)
        }

    def fail(self, key: str, message: str) -> NoReturn:
        self.where.child(key).fail(message)

    def required(self, key: str, parse: Parse[_T], fix: str) -> _T:
        if self._raw.get(key) is None:
            self.fail(key, f"required; {fix}")
        return parse(self._raw[key], self.where.child(key))

    @overload
    def optional(self, key: str, parse: Parse[_T]) -> _T: ...
    @overload
    def optional(self, key: str, parse: Parse[_T], default: _D) -> _T | _D: ...
    def optional(self, key: str, parse: Parse[_T], default: Any = MISSING) -> Any:
        """The value of `key`; left out, `default` or else the default its dataclass declares (written only there)."""
        default = self._defaults[key] if default is MISSING else default
        if key not in self._raw:
            return default
        value = self._raw[key]
        if value is None:
            shown = "auto-detected" if default is None else _yaml_repr(default)
            self.fail(key, f"null is not allowed here; remove the key to use the default ({shown})")
        return parse(value, self.where.child(key))

    def nullable(self, key: str, parse: Parse[_T]) -> _T | None:
        value = self._raw.get(key)
        return None if value is None else parse(value, self.where.child(key))


def check_keys(where: Where, raw: Mapping[Any, Any], keys: Sequence[str], *, noun: str) -> None:
    """Fail on the first key of `raw` that is not one of `keys` (`noun` names them: "key", "section")."""
    for key in raw:
        if not isinstance(key, str):
            where.fail(f"{describe(key)} is not a valid {noun} name; expected one of {', '.join(keys)}")
        if key not in keys:
            where.child(key).fail(f"unknown {noun} ({suggest(key, keys)})")


def suggest(key: str, keys: Sequence[str]) -> str:
    """The end of an "unknown key" message: "did you mean 'x'?" when one of `keys` is close, else all of them."""
    normal = key.strip().lower().replace("-", "_")
    close = [normal] if normal in keys else difflib.get_close_matches(normal, keys, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(keys)}"


def field_names(cls: type) -> tuple[str, ...]:
    """The keys of a section: the field names of its dataclass."""
    return tuple(f.name for f in fields(cls))


# --------------------------------------------------------------------------- value parsers


def describe(value: object) -> str:
    """How a wrong value is shown in a message: its YAML spelling and kind."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return f"the string {shown!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"a {type(value).__name__} ({value!s})"


def file_kind(mode: int) -> str:
    """What an `st_mode` is, as messages say it: "a file", "a directory", "a FIFO", ..."""
    kinds = {
        stat.S_ISREG: "a file",
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    return next((name for test, name in kinds.items() if test(mode)), "a special file")


def _yaml_repr(value: object) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer(minimum: int, maximum: int = 2**31 - 1) -> Parse[int]:
    """A parse function for whole numbers from `minimum` to `maximum` (a quoted "3" or a 3.0 is refused, with the
    fix)."""

    def parse(value: object, where: Where) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            hint = ""
            if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
                hint = "; write it without quotes"
            elif isinstance(value, float) and value.is_integer():
                hint = f"; write {int(value)}"
            where.fail(f"expected a whole number >= {minimum}, got {describe(value)}{hint}")
        if value < minimum:
            where.fail(f"must be at least {minimum}, got {_short_number(value)}")
        if value > maximum:
            where.fail(f"must be at most {maximum}, got {_short_number(value)}")
        return value

    return parse


def _short_number(value: int | float) -> str:
    """A number as a message shows it: a 400-digit integer is not printed whole."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def number(
    *, low: float, low_ok: bool, high: float = MAX_SECONDS, unit: str = " seconds", fix: str = ""
) -> Parse[float]:
    """A parse function for finite numbers above `low` (or equal to it when `low_ok`) and at most `high`; `fix`
    ends its messages."""

    def parse(value: object, where: Where) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            what = "a number of seconds" if unit else "a number"
            hint = "; write a plain number (every *_s key is in seconds)" if unit and isinstance(value, str) else ""
            where.fail(f"expected {what}, got {describe(value)}{hint}")
        try:
            result = float(value)
        except OverflowError:  # an integer too large for a float
            where.fail(f"must be at most {high:g}{unit}, got {_short_number(value)}{fix}")
        if not math.isfinite(result):
            where.fail(f"{value!r} is not a finite number; write a finite value{fix}")
        if result < low or (result == low and not low_ok):
            bound = "at least" if low_ok else "above"
            where.fail(f"must be {bound} {low:g}{unit}, got {_short_number(value)}{fix}")
        if result > high:
            where.fail(f"must be at most {high:g}{unit}, got {_short_number(value)}{fix}")
        return result

    return parse


def seconds(*, zero_ok: bool = False, fix: str = "") -> Parse[float]:
    """A parse function for a duration in seconds, above 0 (or at least 0 when `zero_ok`)."""
    return number(low=0.0, low_ok=zero_ok, fix=fix)


class Word(str):
    """An unquoted yes, no, on or off as the YAML loader gives it: YAML 1.1 reads these as booleans, and a boolean
    key takes them so (`truth`), while a key of strings takes the word as written (`mode: off`)."""

    @property
    def truth(self) -> bool:
        return self.lower() in ("yes", "on")


def boolean(value: object, where: Where) -> bool:
    if isinstance(value, Word):
        return value.truth
    if not isinstance(value, bool):
        hint = "; write it without quotes" if isinstance(value, str) and value.lower() in ("true", "false") else ""
        where.fail(f"expected true or false, got {describe(value)}{hint}")
    return value


def string(value: object, where: Where) -> str:
    if not isinstance(value, str):
        hint = "; quote it" if isinstance(value, int | float | bool) or not isinstance(value, list | Mapping) else ""
        where.fail(f"expected a string, got {describe(value)}{hint}")
    if not value:
        where.fail("must not be empty")
    if len(value) > MAX_STRING_CHARS:
        where.fail(f"is {len(value)} characters long; at most {MAX_STRING_CHARS} are allowed")
    return str(value)  # a Word as a plain string


def identifier(value: object, where: Where) -> str:
    text = string(value, where)
    if len(text) > MAX_ID_CHARS:
        where.fail(f"is {len(text)} characters long; an id has at most {MAX_ID_CHARS}")
    if not ID.match(text):
        where.fail(
            f"{text!r} is not a valid id; use letters, digits, '.', '_' and '-', starting with a letter or digit"
        )
    return text


def choice(choices: Sequence[str]) -> Parse[str]:
    def parse(value: object, where: Where) -> str:
        text = string(value, where).lower()
        if text not in choices:
            where.fail(f"{value!r} is not one of {', '.join(choices)} ({suggest(text, choices)})")
        return text

    return parse


def _argument(value: object, where: Where) -> str:
    if isinstance(value, str):
        if "\0" in value:
            where.fail("contains a NUL character, which no program can be passed")
        if len(value) > MAX_ARG_CHARS:
            where.fail(f"is {len(value)} characters long; an argument has at most {MAX_ARG_CHARS}")
        return str(value)  # a Word as a plain string
    if is_number(value):
        where.fail(
            f'{describe(value)} is not a string; quote it ("{value}") so the argument is passed exactly as written'
        )
    if value is None:
        where.fail('an empty item (null); remove it, or write "" for an empty argument')
    if isinstance(value, bool):
        where.fail(f"{describe(value)} is not a string; quote it as written so the argument is passed as a string")
    where.fail(f"expected a string argument, got {describe(value)}")


def string_list(value: object, where: Where, example: str = "[--flag, value]") -> tuple[str, ...]:
    if not isinstance(value, list):
        hint = "; split it into a list (no shell runs it)" if isinstance(value, str) else ""
        where.fail(f"expected a list of strings such as {example}, got {describe(value)}{hint}")
    if len(value) > MAX_ARGS:
        where.fail(f"has {len(value)} items; at most {MAX_ARGS} are allowed")
    args = tuple(_argument(item, where.item(i)) for i, item in enumerate(value))
    if (total := sum(len(a) for a in args)) > MAX_ARGV_CHARS:
        where.fail(f"is {total} characters long in all; at most {MAX_ARGV_CHARS} are allowed")
    return args


def argv(value: object, where: Where) -> tuple[str, ...]:
    args = string_list(value, where, example="[python, train.py]")
    if not args or not args[0]:
        where.fail("needs at least a program name, e.g. [python, train.py]")
    return args


def torchrun_args(value: object, where: Where) -> tuple[str, ...]:
    args = string_list(value, where)
    for i, arg in enumerate(args):
        name = arg.partition("=")[0].lstrip("-").replace("_", "-")
        if arg.startswith("--") and name in _TORCHRUN_OWNED:
            where.item(i).fail(f"{arg!r} is set by ftsup; remove it and use {_TORCHRUN_OWNED[name]}")
    return args


def env(value: object, where: Where) -> dict[str, str]:
    if not isinstance(value, Mapping):
        where.fail(f"expected a mapping of NAME: value, got {describe(value)}")
    if len(value) > MAX_ENV_VARS:
        where.fail(f"has {len(value)} variables; at most {MAX_ENV_VARS} are allowed")
    variables: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str) or len(name) > MAX_STRING_CHARS or not _ENV_NAME.match(name):
            shown = describe(name).removeprefix("the string ")
            where.fail(f"{shown} is not a valid environment variable name (letters, digits, '_')")
        if not isinstance(item, str):
            where.child(name).fail(f"expected a string, got {describe(item)}; quote it")
        variables[name] = _argument(item, where.child(name))
    if (total := sum(len(k) + len(v) for k, v in variables.items())) > MAX_ARGV_CHARS:
        where.fail(f"is {total} characters long in all; at most {MAX_ARGV_CHARS} are allowed")
    return variables


def path(base: Path) -> Parse[Path]:
    def parse(value: object, where: Where) -> Path:
        text = string(value, where)
        if text.startswith("~"):
            where.fail(f"{text!r}: '~' is not expanded here; write the full path")
        if "${" in text:
            where.fail(f"{text!r}: environment variables are not expanded in the config; write the value itself")
        if "\0" in text:
            where.fail("a path cannot contain a NUL character")
        return Path(os.path.normpath(base / text))

    return parse


def nproc(value: object, where: Where) -> int | Literal["auto"]:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str):
        where.fail(f"expected a whole number >= 1 or auto, got {describe(value)}")
    return integer(1, MAX_NPROC_PER_NODE)(value, where)


def nnodes(value: object, where: Where) -> str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        where.fail(f"expected a node count N or a range MIN:MAX such as 1:2, got {describe(value)}")
    if isinstance(value, int):
        value = integer(1, MAX_NODES)(value, where)
    low, sep, high = str(value).strip().partition(":")
    if not low.isdigit() or (sep and not high.isdigit()) or len(low) > 6 or len(high) > 6:
        where.fail(f"{describe(value)} is not N or MIN:MAX (whole numbers up to {MAX_NODES}), e.g. 2 or 1:2")
    lowest, highest = int(low), int(high or low)
    if lowest < 1:
        where.fail(f"{value!r}: the node count must be at least 1")
    if highest > MAX_NODES:
        where.fail(f"{value!r}: at most {MAX_NODES} nodes")
    if lowest > highest:
        where.fail(f"{value!r}: MIN {lowest} is above MAX {highest}; write {highest}:{lowest}")
    return str(lowest) if lowest == highest else f"{lowest}:{highest}"


def host_port(*, min_port: int, example: str) -> Parse[str]:
    def parse(value: object, where: Where) -> str:
        if not isinstance(value, str):
            where.fail(f"expected a quoted host:port such as {example}, got {describe(value)}")
        text = string(value, where).strip()
        host, sep, port = text.rpartition(":")
        bare_host = host.removeprefix("[").removesuffix("]")
        if not sep or not bare_host or not port.isdigit():
            where.fail(f"{text!r} is not host:port, e.g. {example}")
        if not min_port <= int(port) <= 65535:
            where.fail(f"port {port} is outside {min_port}..65535")
        return text

    return parse


def url(value: object, where: Where) -> str:
    text = string(value, where).strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        where.fail(f"{text!r} is not an http(s) URL such as http://127.0.0.1:8080")
    return text.rstrip("/")


def providers(value: object, where: Where) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        where.fail(f"expected a list such as [aws] or auto, got {describe(value)}")
    names: list[str] = []
    for i, item in enumerate(items):
        text = string(item, where.item(i)).strip().lower()
        if text not in (*PROVIDERS, "auto"):
            where.item(i).fail(f"{item!r} is not a provider ({suggest(text, (*PROVIDERS, 'auto'))})")
        if text not in names:
            names.append(text)
    if "auto" in names and len(names) > 1:
        where.fail("auto detects the provider; give auto alone or list the providers without it")
    return tuple(names)


def plain_dataclass(value: Any) -> dict[str, Any]:
    """A JSON-ready copy of a dataclass instance: nested dataclasses as dicts, paths as strings, tuples as lists."""
    return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}


def _plain(value: object) -> object:
    if is_dataclass(value) and not isinstance(value, type):
        return plain_dataclass(value)
    if isinstance(value, enum.Enum):  # heartbeat.mode: as YAML spells it, for a YAML or JSON dumper
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
