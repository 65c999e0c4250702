"""The `ftsup` command line: parse argv, run one subcommand, turn errors into exit statuses.

Subcommands (DESIGN.md, Contracts: their names, flags and JSON shapes change only by adding):

    ftsup ckpt list DIR [--json] [--deep]              every committed checkpoint, oldest first
    ftsup ckpt verify DIR [--step N] [--deep] [--json] one checkpoint (default: the newest)
    ftsup bench checkpoint ...                         delegated to `ftsup.trainer.bench`
    ftsup bench recovery ...                           `ftsup.supervisor.bench.recovery` (torch-free)
    ftsup bench eviction ...                           `ftsup.supervisor.bench.eviction` (torch-free)
    ftsup demo [--dir DIR] [--steps N] [--json FILE]   `ftsup.supervisor.faults.demo`: faults injected, bitwise check

Exit statuses: 0 success; 1 the command ran and found a problem (verify: not consistent), or an
internal error (its traceback on stderr, then one line); 2 usage errors, a bad config, a missing or
unreadable file, directory or checkpoint, or any `CheckpointError`, reported as one line
`ftsup: error: ...` on stderr. `ftsup run` has statuses of its own (README, `ftsup.supervisor.policy`):
2 only for what is refused before anything starts, 1 for any failure after that.

This module never imports torch: `ftsup.store.layout` is stdlib-only. Nor does it
import tooling (`ftsup.supervisor.bench`, `ftsup.supervisor.faults`, `ftsup.trainer.bench`, which
needs torch) for a command that does not run it: every command is registered with its one-line
help, so `ftsup --help` lists them all, and only the asked-for one's parser is built, which is
where a tooling command imports its module. It does not decide anything about checkpoints
itself; it prints what `layout` finds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

from ftsup.store import layout
from ftsup.store.errors import CheckpointError, NoCheckpointError
from ftsup.supervisor import export_hf
from ftsup.supervisor.errors import RunError, SupervisorError, UsageError, error_line

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    """A subcommand as its parent's --help lists it; `build(parser, rest)` adds its flags, subcommands and
    handler when it is the one asked for (`rest`: what follows its name, for the choice of its own subcommand)."""

    name: str
    help: str
    build: Callable[[argparse.ArgumentParser, Sequence[str]], None]


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ftsup` with `argv` (default: sys.argv[1:]) and return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(args_list)
        try:
            args = parser.parse_args(args_list)
        except SystemExit as e:  # argparse exits for --help (0) and usage errors (2)
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        handler: Handler = args.handler
        return handler(args)
    # The CLI boundary: a user gets one actionable line, not a traceback, for everything we can name.
    except RunError as e:
        print(f"ftsup: error: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    except (CheckpointError, SupervisorError, OSError) as e:
        print(f"ftsup: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # a bug: the traceback is what its report needs; the last line says what happened
        traceback.print_exc(file=sys.stderr)
        print(f"ftsup: error: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_PROBLEM


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser for `argv`: every command listed, the one `argv` asks for built in full."""
    parser = argparse.ArgumentParser(prog="ftsup", description="Fault-tolerant training supervisor for PyTorch.")
    commands = [
        Command("run", "supervise a training job (a long-running daemon)", _build_run),
        Command("status", "what the supervisor of a job is doing", _build_status),
        Command("config", "check a job config", _build_config),
        Command("ckpt", "inspect a checkpoint directory", _build_ckpt),
        Command("bench", "benchmarks (checkpoint needs torch; see README)", _build_bench),
        Command("demo", "the reference trainer under ftsup run, with faults injected; losses compared bitwise",
                _build_demo),
    ]  # fmt: skip
    _add_commands(parser, commands, argv, dest="command", metavar="COMMAND")
    return parser


def _add_commands(
    parser: argparse.ArgumentParser, commands: Sequence[Command], argv: Sequence[str], *, dest: str, metavar: str
) -> None:
    """Add `commands` to `parser`, each with its help, and build the one `argv` names first: the first
    argument not starting with "-", as argparse reads it too (no level of `ftsup` has an option that
    takes a value before its subcommand). The others stay empty, which is all `--help` needs."""
    asked = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    actions = parser.add_subparsers(dest=dest, metavar=metavar, required=True)
    for command in commands:
        p = actions.add_parser(command.name, help=command.help)
        if asked is not None and argv[asked] == command.name:
            command.build(p, argv[asked + 1 :])
        else:
            p.set_defaults(handler=_not_built)


def _not_built(args: argparse.Namespace) -> int:  # never reached: argparse dispatches to the one built
    raise UsageError(f"ftsup {args.command}: this command's parser was not built; run it as `ftsup {args.command} ...`")


# --------------------------------------------------------------------------- run, status


def _build_run(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    p.add_argument("--config", required=True, type=Path, help="the job's YAML config")
    p.set_defaults(handler=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from ftsup.supervisor import preflight
    from ftsup.supervisor.config import load_config
    from ftsup.supervisor.daemon import Daemon

    # A ConfigError, from the file or from what it names on this host, becomes one line and exit 2: nothing
    # has started yet. From here on, no failure is a config error: a service manager restarts on 1, not on 2.
    cfg = load_config(args.config)
    preflight.check(cfg)
    try:
        daemon = Daemon(cfg)
        code = daemon.run()
    except OSError as e:
        raise RunError(f"cannot start: {error_line(e)}") from e
    if daemon.crash is not None:
        print(f"ftsup: error: {daemon.crash}", file=sys.stderr)
    return code


def _build_config(config: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    p = actions.add_parser(
        "check",
        help="check a job config as `ftsup run` would before it starts anything",
        description="Parse and validate JOB.yaml, then check what it names on this host (job.workdir, "
        "checkpoint.dir, job.state_dir, logging.dir, job.command[0] on the ranks' PATH). Exit 0 and one line "
        "when `ftsup run` would accept it; exit 2 and one line naming the key otherwise.",
    )
    p.add_argument("config", metavar="JOB.yaml", type=Path, help="the job's YAML config")
    p.set_defaults(handler=cmd_config_check)


def cmd_config_check(args: argparse.Namespace) -> int:
    from ftsup.supervisor import preflight
    from ftsup.supervisor.config import load_config

    cfg = load_config(args.config)
    preflight.check(cfg)
    print(
        f"{args.config}: ok (run_id {cfg.job.run_id}, node {cfg.launch.node_id}, checkpoints in {cfg.checkpoint.dir})"
    )
    return EXIT_OK


def _build_status(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    p.add_argument("--config", required=True, type=Path, help="the job's YAML config")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from ftsup.supervisor.status import cmd_status as status

    return status(args)


# --------------------------------------------------------------------------- ckpt


def _build_ckpt(ckpt: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    actions = ckpt.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)

    p = actions.add_parser(
        "list",
        help="list committed checkpoints, oldest first",
        description="List every committed checkpoint under DIR, oldest first, and whether it "
        "is consistent (manifest parses, files have the recorded sizes; --deep: checksums).",
    )
    p.add_argument("dir", metavar="DIR", type=Path, help="the checkpoint directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--deep", action="store_true", help="also verify every checksum (reads all)")
    p.set_defaults(handler=cmd_ckpt_list)

    p = actions.add_parser(
        "verify",
        help="verify one checkpoint (default: the newest committed)",
        description="Verify the checkpoint of --step, or else the newest committed one (even "
        "when it is broken: then verify fails). Exit 0 when consistent, 1 when not.",
    )
    p.add_argument("dir", metavar="DIR", type=Path, help="the checkpoint directory")
    p.add_argument("--step", type=_step_number, help="the step to verify (default: newest)")
    p.add_argument("--deep", action="store_true", help="also verify every checksum (reads all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_ckpt_verify)

    p = actions.add_parser(
        "export-hf",
        help="export a checkpoint's model as a Hugging Face model directory (needs torch)",
        description=export_hf.DESCRIPTION,
    )
    export_hf.add_arguments(p, _step_number)
    p.set_defaults(handler=cmd_ckpt_export_hf)


def cmd_ckpt_export_hf(args: argparse.Namespace) -> int:
    try:
        from ftsup.trainer.checkpoint import hf
    except ModuleNotFoundError as e:
        raise UsageError(f"ftsup ckpt export-hf needs {e.name!r}; install torch as the README shows") from None
    return export_hf.run(args, hf)


def _step_number(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"a step number is >= 0, got {step}")
    return step


def cmd_ckpt_list(args: argparse.Namespace) -> int:
    root = _checkpoint_root(args.dir)
    infos = layout.list_checkpoints(root, deep=args.deep)
    if args.json:
        _print_json({"checkpoints": [info.to_json() for info in infos]})
        return EXIT_OK
    if not infos:
        print(f"no committed checkpoints under {root}")
    else:
        print(_checkpoint_table(infos))
        broken = sum(not i.consistent for i in infos)
        check = "deep check (checksums)" if args.deep else "fast check (sizes; --deep: checksums)"
        print(f"\n{len(infos)} committed, {broken} inconsistent; {check}")
    for line in _uncommitted_lines(root):
        print(line)
    return EXIT_OK


def cmd_ckpt_verify(args: argparse.Namespace) -> int:
    root = _checkpoint_root(args.dir)
    committed = dict(layout.committed_dirs(root))
    if args.step is None:
        if not committed:
            raise NoCheckpointError(f"no committed checkpoint under {root}")
        path = committed[max(committed)]
    elif args.step in committed:
        path = committed[args.step]
    else:
        raise NoCheckpointError(_no_step_message(root, args.step))

    manifest, problems = layout.check_checkpoint(path, deep=args.deep)
    consistent = manifest is not None and not problems
    step = manifest.step if manifest else layout.parse_step_dirname(path.name)
    if args.json:
        _print_json(
            {
                "path": str(path),
                "step": step,
                "consistent": consistent,
                "deep": args.deep,
                "problems": [{"file": p.file, "reason": p.reason} for p in problems],
                "kind": manifest.kind if manifest else None,
                "world_size": manifest.world_size if manifest else None,
                "created_unix": manifest.created_unix if manifest else None,
                "files": len(manifest.files) if manifest else None,
                "bytes": sum(e.size for e in manifest.files.values()) if manifest else None,
            }
        )
    elif manifest is not None and consistent:
        total = sum(e.size for e in manifest.files.values())
        how = "checksums verified" if args.deep else "sizes checked; --deep verifies checksums"
        print(
            f"{path.name}: consistent ({manifest.kind}, world size {manifest.world_size}, "
            f"{len(manifest.files)} files, {_human_bytes(total)}; {how})"
        )
    else:
        print(f"{path.name}: NOT consistent ({len(problems)} problem(s)):")
        for p in problems:
            print(f"  {p}")
        if args.step is None:
            fallback = layout.latest_consistent(root, below=step)
            print(
                f"the newest older checkpoint passing the fast check is step {fallback.step}"
                if fallback
                else "no older checkpoint passes the fast check either"
            )
    return EXIT_OK if consistent else EXIT_PROBLEM


def _checkpoint_root(path: Path) -> Path:
    if not path.exists():
        raise UsageError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise UsageError(f"{path} is not a directory")
    return path


def _no_step_message(root: Path, step: int) -> str:
    name = layout.step_dirname(step)
    others = sorted(p.name for p in root.glob(f"{name}.*"))
    found = f" (found {', '.join(others)}: not committed)" if others else ""
    return f"no committed checkpoint for step {step} under {root}{found}"


def _uncommitted_lines(root: Path) -> list[str]:
    """Partial and quarantined directories, and what is named like a checkpoint but is none
    (a link, a file, a name ftsup never writes): not checkpoints, but worth seeing."""
    committed = {p.name for _, p in layout.committed_dirs(root)}
    lines = []
    for p in sorted(root.iterdir()):
        if layout.parse_partial_dirname(p.name) is not None:
            lines.append(f"not committed: {p.name} (a save in progress or torn by a crash)")
        elif p.name.startswith("step-") and ".corrupt" in p.name:
            lines.append(f"quarantined: {p.name}")
        elif p.name.startswith("step-") and p.name not in committed:
            why = (
                "a symbolic link"
                if p.is_symlink()
                else "not a directory"
                if not p.is_dir()
                else "not a name ftsup writes"
            )
            lines.append(f"not a checkpoint: {p.name[:60]} ({why})")
    return lines


def _checkpoint_table(infos: Sequence[layout.CheckpointInfo]) -> str:
    rows = [("STEP", "KIND", "WORLD", "CREATED (UTC)", "STATUS", "PATH")]
    for i in infos:
        rows.append(
            (
                str(i.step),
                i.kind or "-",
                str(i.world_size) if i.world_size is not None else "-",
                _utc(i.created_unix),
                "ok" if i.consistent else "INCONSISTENT",
                i.path,
            )
        )
    # Pad every column but the last (the path), so long paths do not widen the table.
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    lines = []
    for row, info in zip(rows, [None, *infos], strict=True):
        padded = [row[c].ljust(w) for c, w in enumerate(widths)]
        lines.append("  ".join([*padded, row[-1]]))
        lines.extend(f"    {p}" for p in (info.problems if info else ()))
    return "\n".join(lines)


def _utc(created_unix: float | None) -> str:
    if created_unix is None:
        return "-"
    return datetime.fromtimestamp(created_unix, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


# --------------------------------------------------------------------------- bench, demo: tooling


def _build_bench(bench: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    benchmarks = [
        Command("recovery", "fault -> first resumed step, ftsup vs torchrun --max-restarts=3", _build_bench_recovery),
        Command("eviction", "steps lost per eviction: ftsup's emergency saves vs periodic checkpoints only",
                _build_bench_eviction),
        Command("checkpoint", "checkpoint save/load throughput", _build_bench_checkpoint),
    ]  # fmt: skip
    _add_commands(bench, benchmarks, rest, dest="bench_command", metavar="BENCHMARK")


def _build_bench_recovery(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    from ftsup.supervisor.bench import recovery

    recovery.add_arguments(p)
    p.set_defaults(handler=recovery.run)


def _build_bench_eviction(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    from ftsup.supervisor.bench import eviction

    p.description, p.formatter_class = eviction.__doc__, argparse.RawDescriptionHelpFormatter
    eviction.add_arguments(p)
    p.set_defaults(handler=eviction.run)


def _build_bench_checkpoint(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    p.description = "Benchmark the checkpoint engine (see trainer/bench/)."
    module = _import_bench()
    add_arguments = getattr(module, "add_checkpoint_arguments", None)
    run = getattr(module, "run_checkpoint", None)
    if add_arguments is None or run is None:
        raise UsageError(
            f"{module.__name__} does not provide add_checkpoint_arguments and run_checkpoint; "
            "this installation's benchmark is incomplete"
        )
    add_arguments(p)
    p.set_defaults(handler=run)


def _import_bench() -> ModuleType:
    try:
        return importlib.import_module("ftsup.trainer.bench")
    except ModuleNotFoundError as e:
        if e.name == "ftsup.trainer.bench":
            raise UsageError(f"this ftsup installation has no benchmarks ({e})") from None
        raise UsageError(
            f"ftsup bench needs module {e.name!r}, which is not installed; install torch "
            "first, then ftsup with its extras, as the README shows"
        ) from None


def _build_demo(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    from ftsup.supervisor.faults import demo

    demo.add_arguments(p)
    p.set_defaults(handler=demo.run)


if __name__ == "__main__":
    sys.exit(main())
