"""The job config from the command line (`ftsup run`, `ftsup config check`): every key a flag, a YAML file or none.

`add_arguments(parser)` adds the flags; `load(config, overrides, command)` returns the `JobConfig`. It reads the
config file and nothing else (docs/design/config.md, Flags).
"""

from __future__ import annotations

import argparse
import ast
import copy
import inspect
import os
import textwrap
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ftsup.supervisor.config import file as config_file
from ftsup.supervisor.config import job as config
from ftsup.supervisor.config.values import Where, check_keys, field_names
from ftsup.supervisor.errors import ConfigError, UsageError

IMPLIED: dict[str, dict[str, object]] = {"launch": {"nproc_per_node": 1}}
"""What `ftsup run -- CMD` starts from without a config file, before the flags."""
TORCHRUN_NAMES = {
    "nproc-per-node": "launch.nproc_per_node",
    "nnodes": "launch.nnodes",
    "rdzv-endpoint": "launch.rdzv_endpoint",
    "rdzv-id": "launch.rdzv_id",
    "max-restarts": "restart.max_restarts",
}
NO_INSTRUMENT = "--no-instrument"  # the one flag that is not a key's: launch.instrument false
COMMAND = "the command after --"
SOURCE = "command line"


@dataclass(frozen=True)
class Override:
    """One key given on the command line: `value` is YAML text (a flag's) or, for the command after `--`, the
    argv itself; `origin` is how it was given ("--set", "--heartbeat-mode", `COMMAND`), for messages."""

    key: str
    value: str | list[str]
    origin: str


def sections() -> dict[str, type]:
    """Each section's name and its dataclass, in the config's order."""
    hints = typing.get_type_hints(config.JobConfig)
    return {name: hints[name] for name in config.SECTIONS}


def flag(key: str) -> str:
    """The flag of "section.key": `--section-key`, underscores as dashes."""
    return "--" + key.replace(".", "-").replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--set` and one flag per key, grouped by section; each collects into `overrides`, in the order given."""
    parser.set_defaults(overrides=None)
    parser.add_argument(
        "--set",
        metavar="SECTION.KEY=VALUE",
        action=_Collect,
        dest="overrides",
        help="any key of the job config, its value as YAML: --set heartbeat.mode=off",
    )
    parser.add_argument(
        "--no-instrument",
        nargs=0,
        action=_Collect,
        dest="overrides",
        const=NO_INSTRUMENT,
        help="run the ranks as they are, without the auto-instrumentation (launch.instrument: false)",
    )
    aliases = {key: name for name, key in TORCHRUN_NAMES.items()}
    for section, cls in sections().items():
        group = parser.add_argument_group(f"the {section} section (deploy/examples/job.yaml: every key, its default)")
        docs = _first_sentences(cls)
        for name in field_names(cls):
            key = f"{section}.{name}"
            names = [flag(key)] + ([f"--{aliases[key]}"] if key in aliases else [])
            group.add_argument(
                *names,
                metavar="VALUE",
                action=_Collect,
                dest="overrides",
                const=key,
                help=docs.get(name, key).replace("%", "%%"),
            )


class _Collect(argparse.Action):
    """Append an `Override` to `namespace.overrides`: the key is `const`, or for `--set` what precedes the `=`."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: str | None = None) -> None:
        text = str(values)
        if self.const == NO_INSTRUMENT:
            key, text, origin = "launch.instrument", "false", NO_INSTRUMENT
        elif self.const is not None:
            key, origin = self.const, option or self.const
        else:
            key, sep, text = text.partition("=")
            if not sep or key.count(".") != 1:
                raise ConfigError(f"--set {values}: expected SECTION.KEY=VALUE, e.g. --set heartbeat.mode=off")
            key, origin = key.strip(), "--set"
        collected = list(getattr(namespace, self.dest) or [])
        setattr(namespace, self.dest, [*collected, Override(key, text, origin)])


def python_command(argv: Sequence[str]) -> list[str]:
    """The command after `--` as it runs: under `python` when it starts with a script (`*.py`) or an option."""
    first = argv[0]
    return ["python", *argv] if first.endswith(".py") or first.startswith("-") else list(argv)


def load(
    path: Path | None,
    overrides: Sequence[Override] | None,
    command: Sequence[str] | None,
    *,
    hostname: str | None = None,
) -> config.JobConfig:
    """The config of the file at `path` (None: `IMPLIED` in the current directory) with `overrides` and the
    `command` after `--` (None: no `--`) applied. Raises `ConfigError`, or `UsageError` for a missing command."""
    given = list(overrides or ())
    if command is not None:
        if not command:
            raise UsageError("nothing follows --; give the training command, e.g. ftsup run -- python train.py")
        given.append(Override("job.command", python_command(command), COMMAND))
    if path is None:
        if not any(o.key == "job.command" for o in given):
            raise UsageError(
                "give the training command after --, e.g. ftsup run -- python train.py, "
                "or a job config (ftsup run --config JOB.yaml)"
            )
        raw: object = copy.deepcopy(IMPLIED)
        source, base, config_path = SOURCE, Path(os.path.abspath(os.curdir)), None
    else:
        raw, source = config.read_document(path), os.fspath(path)
        config_path = Path(os.path.abspath(path))
        base = config_path.parent
    origins = _apply(raw, given)
    return config.parse_config(
        raw, source=source, base_dir=base, config_path=config_path, hostname=hostname, origins=origins
    )


def _apply(raw: object, given: Sequence[Override]) -> dict[str, str]:
    """Write each override into the document `raw` (in place) after checking its key; return where each key's
    value came from. A section that is not a mapping is left as it is, for `parse_config` to name."""
    kinds = sections()
    origins: dict[str, str] = {}
    for o in given:
        section, _, name = o.key.partition(".")
        where = Where(o.origin)
        check_keys(where, {section: None}, config.SECTIONS, noun="section")
        check_keys(where.child(section), {name: None}, field_names(kinds[section]), noun="key")
        if o.key in origins:
            where.child(o.key).fail(f"given twice on the command line (first by {origins[o.key]}); keep one")
        origins[o.key] = o.origin
        value = o.value if isinstance(o.value, list) else config_file.load_yaml(o.value, f"{o.origin} {o.key}")
        current = raw.get(section) if isinstance(raw, dict) else None
        if isinstance(raw, dict) and (current is None or isinstance(current, Mapping)):
            raw[section] = {**(current or {}), name: value}
    return origins


def _first_sentences(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), to its first full stop: the flags' help."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError, SyntaxError):  # no source installed: the flags go without help
        return {}
    if not isinstance(body, ast.ClassDef):
        return {}
    docs: dict[str, str] = {}
    names = {f.name for f in fields(cls)}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names:
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                text = " ".join(str(after.value.value).split())
                docs[node.target.id] = text.split(". ")[0].rstrip(".") + "."
    return docs
