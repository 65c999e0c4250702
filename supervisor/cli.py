"""The `ftsup` command line: parse argv, run one subcommand, turn errors into exit statuses.

Subcommands (ARCHITECTURE section 5 is the contract for names, flags and JSON shapes):

    ftsup ckpt list DIR [--json] [--deep]              every committed checkpoint, oldest first
    ftsup ckpt verify DIR [--step N] [--deep] [--json] one checkpoint (default: the newest)
    ftsup bench checkpoint ...                         delegated to `ftsup.trainer.bench`
    ftsup bench recovery ...                           `ftsup.supervisor.bench_recovery` (torch-free)
    ftsup demo [--dir DIR] [--steps N] [--json FILE]   `ftsup.supervisor.demo`: faults injected, bitwise check

Exit statuses: 0 success; 1 the command ran and found a problem (verify: not consistent), or an
internal error (its traceback on stderr, then one line); 2 usage errors, a bad config, a missing or
unreadable file, directory or checkpoint, or any `CheckpointError`, reported as one line
`ftsup: error: ...` on stderr. `ftsup run` has statuses of its own (README, `ftsup.supervisor.policy`):
2 only for what is refused before anything starts, 1 for any failure after that.

This module never imports torch: `ftsup.store.layout` is stdlib-only, and the
benchmark module is imported only when `ftsup bench` is what was asked for. It does not
decide anything about checkpoints itself; it prints what `layout` finds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

from ftsup.store import layout
from ftsup.store.errors import CheckpointError, NoCheckpointError
from ftsup.supervisor.errors import RunError, SupervisorError, UsageError, error_line

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2

Handler = Callable[[argparse.Namespace], int]


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ftsup` with `argv` (default: sys.argv[1:]) and return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        torch_free_bench = _asks_for(args_list, "recovery", 1) or _asks_for(args_list, "eviction", 1)
        parser = build_parser(load_bench=_asks_for(args_list, "bench") and not torch_free_bench)
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


def build_parser(*, load_bench: bool = False) -> argparse.ArgumentParser:
    """The full parser; `load_bench` imports `ftsup.trainer.bench` to add its flags (needs torch)."""
    parser = argparse.ArgumentParser(
        prog="ftsup",
        description="Fault-tolerant training supervisor for PyTorch.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # One registrar per top-level command; `run`, `status`, `export-hf` and `demo`
    # (ARCHITECTURE section 5) slot in here as they are written.
    _add_run(commands)
    _add_status(commands)
    _add_config(commands)
    _add_ckpt(commands)
    _add_bench(commands, load=load_bench)
    _add_demo(commands)
    return parser


# --------------------------------------------------------------------------- run, status


def _add_run(commands: Any) -> None:
    p = commands.add_parser("run", help="supervise a training job (a long-running daemon)")
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


def _add_config(commands: Any) -> None:
    config = commands.add_parser("config", help="check a job config")
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


def _add_status(commands: Any) -> None:
    p = commands.add_parser("status", help="what the supervisor of a job is doing")
    p.add_argument("--config", required=True, type=Path, help="the job's YAML config")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    import psutil

    from ftsup.supervisor.config import load_config
    from ftsup.supervisor.journal import Journal

    cfg = load_config(args.config)
    rec = Journal(Path(cfg.job.state_dir) / "journal.json").read()
    latest = layout.latest_consistent(cfg.checkpoint.dir)
    alive = rec is not None and psutil.pid_exists(rec.supervisor_pid) and rec.status not in (
        "succeeded", "failed", "stopped", "evicted")  # fmt: skip
    out = {
        "run_id": cfg.job.run_id,
        "node_id": cfg.launch.node_id,
        "supervisor_running": bool(alive),
        "journal": rec.to_json() if rec else None,
        "latest_checkpoint": latest.to_json() if latest else None,
        "checkpoint_dir": str(cfg.checkpoint.dir),
    }
    if args.json:
        _print_json(out)
        return EXIT_OK
    print(f"run {out['run_id']} on node {out['node_id']}: supervisor {'running' if alive else 'not running'}")
    if rec:
        print(f"  status {rec.status}, attempt {rec.attempt}, world size {rec.world_size}, "
              f"resumed from step {rec.resume_step}")  # fmt: skip
        if rec.last_failure:
            print(f"  last failure: {rec.last_failure}")
        if rec.extra.get("metrics"):
            print(f"  metrics: http://{rec.extra['metrics']}/metrics")
    print(f"  latest consistent checkpoint: {latest.step if latest else 'none'} in {cfg.checkpoint.dir}")
    return EXIT_OK


def _asks_for(argv: Sequence[str], command: str, position: int = 0) -> bool:
    """Whether the positional argument at `position` is `command` (there are no global options yet)."""
    positionals = [a for a in argv if not a.startswith("-")]
    return len(positionals) > position and positionals[position] == command


# --------------------------------------------------------------------------- ckpt


def _add_ckpt(commands: Any) -> None:
    ckpt = commands.add_parser("ckpt", help="inspect a checkpoint directory")
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
        help="export a checkpoint's model as Hugging Face sharded safetensors (needs torch)",
        description="Write OUT/model-0000k-of-0000n.safetensors and OUT/model.safetensors.index.json from "
        "checkpoint --step (default: the latest consistent one), whatever world size saved it. The checkpoint "
        "is deep-verified first; OUT must not exist or be empty.",
    )
    p.add_argument("dir", metavar="DIR", type=Path, help="the checkpoint directory")
    p.add_argument("--step", type=_step_number, help="the step to export (default: latest consistent)")
    p.add_argument("out", metavar="OUT", type=Path, help="the output directory")
    p.add_argument("--prefix", help="key prefix of the model's tensors (default: found automatically)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest file size (default 5 GB)")
    p.set_defaults(handler=cmd_ckpt_export_hf)


def cmd_ckpt_export_hf(args: argparse.Namespace) -> int:
    try:
        from ftsup.trainer.checkpoint.hf import export_hf
    except ModuleNotFoundError as e:
        raise UsageError(f"ftsup ckpt export-hf needs {e.name!r}; install torch as the README shows") from None
    index = export_hf(args.dir, args.step, args.out, prefix=args.prefix, max_shard_bytes=int(args.max_shard_gb * 1e9))
    files = sorted(set(index["weight_map"].values()))
    print(f"exported step {index['metadata']['ftsup_step']}: {len(index['weight_map'])} tensors, "
          f"{index['metadata']['total_size']} bytes in {len(files)} file(s) under {args.out}")  # fmt: skip
    return EXIT_OK


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


# --------------------------------------------------------------------------- bench


def _add_bench(commands: Any, *, load: bool) -> None:
    from ftsup.supervisor import bench_recovery

    bench = commands.add_parser("bench", help="benchmarks (checkpoint needs torch; see README)")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    p = kinds.add_parser(
        "recovery",
        help="fault -> first resumed step, ftsup vs torchrun --max-restarts=3",
        description="Inject SIGKILL and SIGSTOP into the reference trainer's ranks under ftsup run and under "
        "plain torchrun; report detection and recovery times, lost steps and orphans (see "
        "supervisor/bench_recovery.py). Runs torch only in subprocesses.",
    )
    bench_recovery.add_arguments(p)
    p.set_defaults(handler=bench_recovery.run)
    from ftsup.supervisor import bench_eviction

    p = kinds.add_parser(
        "eviction",
        help="steps lost per eviction: ftsup's emergency saves vs periodic checkpoints only",
        description=bench_eviction.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_eviction.add_arguments(p)
    p.set_defaults(handler=bench_eviction.run)
    p = kinds.add_parser(
        "checkpoint",
        help="checkpoint save/load throughput",
        description="Benchmark the checkpoint engine (see trainer/bench.py).",
    )
    if not load:
        # Building `ftsup ckpt ...` must not import torch; this stub is never dispatched to,
        # because `main` loads the real one whenever `bench` is the command.
        p.set_defaults(handler=_bench_not_loaded)
        return
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


def _add_demo(commands: Any) -> None:
    from ftsup.supervisor import demo

    p = commands.add_parser(
        "demo",
        help="the reference trainer under ftsup run, with faults injected; losses compared bitwise",
        description="Run the reference trainer under `ftsup run` uninterrupted, then again while SIGKILLing a "
        "rank, SIGSTOPping a rank and SIGKILLing the supervisor; report detection and recovery and compare the "
        "loss logs bitwise. Exit 0 only when everything matched and nothing is left running.",
    )
    demo.add_arguments(p)
    p.set_defaults(handler=demo.run)


def _bench_not_loaded(args: argparse.Namespace) -> int:
    raise UsageError("the benchmark was not loaded; run it as `ftsup bench checkpoint ...`")


if __name__ == "__main__":
    sys.exit(main())
