"""The `ftsup` command line: parse argv, run one subcommand, turn errors into exit statuses.

Every command, its flags and exit statuses: docs/cli.md. Torch-free; only the asked-for command's parser is built,
so tooling is imported only by the command that runs it (DESIGN.md, Layout and the direction of dependencies).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftsup import extras
from ftsup.store.errors import CheckpointError
from ftsup.supervisor.cli import ckpt as cli_ckpt
from ftsup.supervisor.cli import export_dcp, export_hf, import_deepspeed
from ftsup.supervisor.cli import show as cli_show
from ftsup.supervisor.cli.ckpt import print_json as _print_json
from ftsup.supervisor.errors import RunError, SupervisorError, UsageError, error_line

if TYPE_CHECKING:
    from ftsup.supervisor.config.job import JobConfig

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
    args_list, command = _split_command(list(sys.argv[1:] if argv is None else argv))
    try:
        parser = build_parser(args_list)
        try:
            args = parser.parse_args(args_list)
        except SystemExit as e:  # argparse exits for --help (0) and usage errors (2)
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        args.command_argv = command
        handler: Handler = args.handler
        if args.command in _TOOLING:
            signal.signal(signal.SIGTERM, _terminated)
        return handler(args)
    # The CLI boundary: a user gets one actionable line, not a traceback, for everything we can name.
    except RunError as e:
        print(f"ftsup: error: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    except OSError as e:  # the path and what is wrong with it, never an errno number
        print(f"ftsup: error: {error_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, SupervisorError, extras.MissingExtraError) as e:
        print(f"ftsup: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # a bug: the traceback is what its report needs; the last line says what happened
        traceback.print_exc(file=sys.stderr)
        print(f"ftsup: error: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_PROBLEM


_TOOLING = frozenset({"bench", "demo", "chaos"})  # they start jobs of their own, and stop them when they leave


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM to a tooling command: leave as from an exception (its `finally` stops the jobs it started), with
    the status a shell gives a process killed by SIGTERM."""
    raise SystemExit(128 + signum)


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """For `ftsup run` and `ftsup config check`, what follows the first `--` is the training command, never read
    as ftsup's flags: (the rest, the command); None when there is none."""
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    words = [a for a in argv[:cut] if not a.startswith("-")]
    if words[:1] == ["run"] or words[:2] == ["config", "check"]:
        return argv[:cut], argv[cut + 1 :]
    return argv, None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser for `argv`: every command listed, the one `argv` asks for built in full."""
    parser = argparse.ArgumentParser(prog="ftsup", description="Fault-tolerant training supervisor for PyTorch.")
    commands = [
        Command("run", "supervise a training job (a long-running daemon)", _build_run),
        Command("status", "what the supervisor of a job is doing", _build_status),
        Command("config", "check a job config", _build_config),
        Command("ckpt", "inspect a checkpoint directory", _build_ckpt),
        Command("rollback", "ask a job's supervisor to resume from an earlier checkpoint", _build_rollback),
        Command(
            "incidents", "the incidents kept (hangs with every rank's stacks, stragglers, anomalies)", _build_incidents
        ),
        Command("nodes", "this node's health, quarantine and hot spare; clear a quarantine", _build_nodes),
        Command("bench", "benchmarks (checkpoint needs torch; see README)", _build_bench),
        DEMO.command(""),
        CHAOS.command(""),
    ]
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
    from ftsup.supervisor.config import args as config_args

    p.usage = "ftsup run [--config JOB.yaml] [--SECTION-KEY VALUE | --set SECTION.KEY=VALUE ...] [-- CMD [ARGS ...]]"
    p.description = (
        "Supervise a training job: the one of JOB.yaml, or CMD (`ftsup run -- python train.py ARGS`; a script "
        "or -m module runs under python), with any key of the config given as a flag, which overrides the file. "
        "Without JOB.yaml: one rank per node (--nproc-per-node), state in ./.ftsup/<node>, checkpoints in "
        "./.ftsup/checkpoints."
    )
    p.allow_abbrev = False  # a config key is named in full: a new key must not change what an abbreviation means
    p.add_argument("--config", type=Path, metavar="JOB.yaml", help="the job's YAML config (optional given a command)")
    config_args.add_arguments(p)
    p.set_defaults(handler=cmd_run)


def _job_config(args: argparse.Namespace, path: Path | None) -> JobConfig:
    """The `JobConfig` of the file `path` (or none), the flags and the command after `--`, checked on this host."""
    from ftsup.supervisor.config import args as config_args
    from ftsup.supervisor.run import preflight

    cfg = config_args.load(path, args.overrides, args.command_argv)
    preflight.check(cfg)
    return cfg


def cmd_run(args: argparse.Namespace) -> int:
    from ftsup.supervisor.run.daemon import Daemon

    # A ConfigError, from the file or from what it names on this host, becomes one line and exit 2: nothing
    # has started yet. From here on, no failure is a config error: a service manager restarts on 1, not on 2.
    cfg = _job_config(args, args.config)
    try:
        daemon = Daemon(cfg)
        code = daemon.run()
    except OSError as e:
        raise RunError(f"cannot start: {error_line(e)}") from e
    if daemon.crash is not None:
        print(f"ftsup: error: {daemon.crash}", file=sys.stderr)
    return code


def _build_config(config: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    from ftsup.supervisor.config import args as config_args

    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    p = actions.add_parser(
        "check",
        help="check a job config as `ftsup run` would before it starts anything",
        usage="ftsup config check [JOB.yaml] [--json] [--SECTION-KEY VALUE | --set SECTION.KEY=VALUE ...] "
        "[-- CMD [ARGS ...]]",
        description="Parse and validate the config `ftsup run` would run with the same arguments (JOB.yaml, the "
        "flags, the command after --), then check what it names on this host (job.workdir, checkpoint.dir, "
        "job.state_dir, logging.dir, job.command[0] on the ranks' PATH). Exit 0 and one line when `ftsup run` "
        "would accept it; exit 2 and one line naming the key otherwise. Nothing is created or started.",
    )
    p.allow_abbrev = False
    p.add_argument("config", metavar="JOB.yaml", type=Path, nargs="?", help="the job's YAML config")
    p.add_argument("--json", action="store_true", help="print the whole config, every default filled in")
    config_args.add_arguments(p)
    p.set_defaults(handler=cmd_config_check)


def cmd_config_check(args: argparse.Namespace) -> int:
    cfg = _job_config(args, args.config)
    if args.json:
        _print_json(cfg.to_dict())
        return EXIT_OK
    tier = cfg.checkpoint.durable
    durable = f", durable tier {tier.url}" if tier is not None else ""
    print(
        f"{cfg.source}: ok (run_id {cfg.job.run_id}, node {cfg.launch.node_id}, command {' '.join(cfg.job.command)}, "
        f"state in {cfg.job.state_dir}, checkpoints in {cfg.checkpoint.dir}{durable})"
    )
    return EXIT_OK


def _build_status(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    p.add_argument("--config", required=True, type=Path, help="the job's YAML config")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from ftsup.supervisor.cli.status import cmd_status as status

    return status(args)


def _build_rollback(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    from ftsup.supervisor.cli import rollback as cli_rollback

    cli_rollback.add_arguments(p, _step_number)


def _build_incidents(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    from ftsup.supervisor.cli import incidents as cli_incidents

    cli_incidents.add_arguments(p)


def _build_nodes(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    from ftsup.supervisor.cli import nodes as cli_nodes

    cli_nodes.add_arguments(p)


# --------------------------------------------------------------------------- ckpt


def _store(text: str) -> Path | str:
    """A checkpoint directory, or a durable tier on object storage kept as its URL (a Path would fold its `//`)."""
    if text.startswith("s3://"):
        from ftsup.store import durable

        try:
            return durable.parse_location(text).url
        except CheckpointError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return Path(text)


def _timeout_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        help="for a durable tier s3://...: the longest the command may take reading it (default 600); past it, "
        "it fails naming the deadline",
    )


def _seconds(text: str) -> float:
    from ftsup.store import durable

    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= durable.MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, {durable.MAX_TIMEOUT_S:g}]")
    return value


def _build_ckpt(ckpt: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    actions = ckpt.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    _add_store_read(
        actions,
        "list",
        "list committed checkpoints, oldest first",
        "List every committed checkpoint under DIR, oldest first, and whether it "
        "is consistent (manifest parses, files have the recorded sizes; --deep: checksums).",
        cli_ckpt.cmd_list,
    )
    _add_store_read(
        actions,
        "verify",
        "verify one checkpoint (default: the newest committed)",
        "Verify the checkpoint of --step, or else the newest committed one (even "
        "when it is broken: then verify fails). Exit 0 when consistent, 1 when not.",
        cli_ckpt.cmd_verify,
        step_help="the step to verify (default: newest)",
    )
    cli_show.add_command(actions, _step_number)
    cli_ckpt.add_commands(actions, _step_number)  # pin, unpin
    for name, help, module, handler in _TORCH_COMMANDS:
        p = actions.add_parser(name, help=help, description=module.DESCRIPTION)
        module.add_arguments(p, _step_number)
        p.set_defaults(handler=handler)


def _add_store_read(
    actions: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help: str,
    description: str,
    handler: Handler,
    *,
    step_help: str | None = None,
) -> None:
    """A command that reads a checkpoint directory or a durable tier: DIR, --step (where `step_help` says what it
    picks), --deep, --json and --timeout."""
    p = actions.add_parser(name, help=help, description=description)
    p.add_argument(
        "dir", metavar="DIR", type=_store, help="the checkpoint directory, or a durable tier s3://BUCKET/PREFIX"
    )
    if step_help is not None:
        p.add_argument("--step", type=_step_number, help=step_help)
    p.add_argument("--deep", action="store_true", help="also verify every checksum (reads all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _timeout_argument(p)
    p.set_defaults(handler=handler)


@contextlib.contextmanager
def _needs_torch(command: str) -> Iterator[None]:
    """The lazy import of a command that needs the trainer extra: a missing library is a usage error naming it."""
    try:
        yield
    except ModuleNotFoundError as e:
        raise UsageError(extras.needs(e, command)) from None


def cmd_ckpt_export_hf(args: argparse.Namespace) -> int:
    with _needs_torch("ftsup ckpt export-hf"):
        from ftsup.trainer.hf import export as hf
    return export_hf.run(args, hf)


def cmd_ckpt_import_deepspeed(args: argparse.Namespace) -> int:
    with _needs_torch("ftsup ckpt import-deepspeed"):
        from ftsup.trainer.deepspeed import convert
    return import_deepspeed.run(args, convert)


def cmd_ckpt_export_dcp(args: argparse.Namespace) -> int:
    with _needs_torch("ftsup ckpt export-dcp"):
        from ftsup.trainer.dcp import export as dcp
    return export_dcp.run(args, dcp)


_TORCH_COMMANDS: tuple[tuple[str, str, Any, Handler], ...] = (
    (
        "export-hf",
        "export a checkpoint's model as a Hugging Face model directory (needs torch)",
        export_hf,
        cmd_ckpt_export_hf,
    ),
    (
        "export-dcp",
        "export a checkpoint's tensors as a torch.distributed.checkpoint directory (needs torch)",
        export_dcp,
        cmd_ckpt_export_dcp,
    ),
    (
        "import-deepspeed",
        "convert a DeepSpeed ZeRO checkpoint's weights to a Hugging Face model directory (needs torch)",
        import_deepspeed,
        cmd_ckpt_import_deepspeed,
    ),
)
"""The ckpt commands whose run needs torch: name, help, the torch-free module of their flags, handler."""


def _step_number(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"a step number is >= 0, got {step}")
    return step


# --------------------------------------------------------------------------- tooling: one table


@dataclass(frozen=True)
class Tool:
    """A tooling command: `module`, imported only when the command is asked for, provides `add_arguments(parser)`
    and `run(args)`. `trainer`: its run needs the trainer extra (torch), though its flags parse without it."""

    name: str
    help: str
    module: str
    trainer: bool = False

    def command(self, parent: str) -> Command:
        return Command(self.name, self.help, lambda p, rest: _build_tool(self, f"{parent}{self.name}", p))


BENCHMARKS = (
    Tool("recovery", "fault -> first resumed step, ftsup vs torchrun --max-restarts=3", "ftsup.tools.bench.recovery"),
    Tool(
        "eviction",
        "steps lost per eviction: ftsup's emergency saves vs periodic checkpoints only",
        "ftsup.tools.bench.eviction",
    ),
    Tool("checkpoint", "checkpoint save/load throughput", "ftsup.tools.bench.checkpoint.command", trainer=True),
    Tool(
        "scale",
        "metadata costs (plan, commit, resume choice, refresh) at N simulated ranks",
        "ftsup.tools.bench.scale.command",
        trainer=True,
    ),
    Tool(
        "anomaly",
        "nan/spike faults: detection delay, rollback vs crash recovery, false positives",
        "ftsup.tools.bench.anomaly",
    ),
    Tool(
        "goodput",
        "productive time / wall time under seeded faults: ftsup vs torchrun vs ft_launcher",
        "ftsup.tools.bench.goodput",
    ),
    Tool(
        "node-loss",
        "goodput of a two-node job under node losses: ftsup with peer memories vs durable tier vs torchrun",
        "ftsup.tools.bench.goodput.nodecommand",
    ),
    Tool(
        "forensics",
        "the evidence of a hang: every rank's stacks captured before the kill, per choice of stack tools",
        "ftsup.tools.bench.forensics.command",
        trainer=True,
    ),
    Tool(
        "instrument",
        "per-step cost of the auto-instrumentation on the reference trainer's model, with and without it",
        "ftsup.tools.bench.instrument",
        trainer=True,
    ),
)
DEMO = Tool(
    "demo",
    "the reference trainer under ftsup run, with faults injected; losses compared bitwise",
    "ftsup.tools.faults.demo",
)
CHAOS = Tool(
    "chaos",
    "a seeded plan of faults of every kind at the reference trainer; invariants checked",
    "ftsup.tools.faults.chaosrun",
)


def _build_bench(bench: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    _add_commands(bench, [t.command("bench ") for t in BENCHMARKS], rest, dest="bench_command", metavar="BENCHMARK")


def _build_tool(tool: Tool, what: str, p: argparse.ArgumentParser) -> None:
    try:
        module = importlib.import_module(tool.module)
    except ModuleNotFoundError as e:
        if e.name is not None and tool.module.startswith(e.name):
            raise UsageError(f"this ftsup installation has no {tool.module} ({e})") from None
        raise UsageError(extras.needs(e, f"ftsup {what}")) from None
    add_arguments = getattr(module, "add_arguments", None)
    run = getattr(module, "run", None)
    if add_arguments is None or run is None:
        raise UsageError(f"{tool.module} does not provide add_arguments and run; this installation is incomplete")
    add_arguments(p)

    def checked(args: argparse.Namespace) -> int:
        if tool.trainer:
            extras.require("trainer", f"ftsup {what}")
        return int(run(args))

    p.set_defaults(handler=checked)


if __name__ == "__main__":
    sys.exit(main())
