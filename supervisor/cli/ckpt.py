"""`ftsup ckpt list|verify|pin|unpin`: what a checkpoint store or a durable tier (`s3://`) holds; pins.

Prints what `ftsup.store` finds and decides nothing itself; a pin or unpin is logged and journaled by `pins`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from ftsup.store import dcpmeta, durable, layout, pins, saving, tiers
from ftsup.store.errors import CheckpointError, NoCheckpointError
from ftsup.supervisor.errors import UsageError
from ftsup.supervisor.telemetry import logs

EXIT_OK = 0
EXIT_PROBLEM = 1


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def cmd_list(args: argparse.Namespace) -> int:
    if _is_tier(args.dir):
        return _list_tier(args)
    root = checkpoint_root(args.dir)
    infos = layout.list_checkpoints(root, deep=args.deep)
    pinset = pins.read_pins(root)
    by_step = {p.step: p for p in pinset.pins}
    if args.json:
        rows = [
            {
                **i.to_json(),
                "pinned": i.step in pinset.kept,
                "pin": by_step[i.step].to_json() if i.step in by_step else None,
            }
            for i in infos
        ]
        out: dict[str, Any] = {"checkpoints": rows}
        if pinset.problems:  # only then: a store without bad pins lists as it always did
            out["pin_problems"] = [str(p) for p in pinset.problems]
        print_json(out)
        return EXIT_OK
    if not infos:
        print(f"no committed checkpoints under {root}")
    else:
        print(checkpoint_table(infos, pinset.kept))
        broken = sum(not i.consistent for i in infos)
        check = "deep check (checksums)" if args.deep else "fast check (sizes; --deep: checksums)"
        print(f"\n{len(infos)} committed, {broken} inconsistent; {check}")
    for line in _uncommitted_lines(root) + _pin_lines(pinset, {i.step for i in infos}):
        print(line)
    return EXIT_OK


def add_commands(actions: Any, step_number: Callable[[str], int]) -> None:
    """`ftsup ckpt pin` and `unpin` on the subcommands `actions` of `ftsup ckpt`."""
    for name, verb, handler in (("pin", "keep", cmd_pin), ("unpin", "stop keeping", cmd_unpin)):
        p = actions.add_parser(
            name,
            help=f"{verb} a checkpoint whatever the retention policy (who and why are journaled)",
            description=f"{name.capitalize()} the checkpoint of --step under DIR: retention never deletes a pinned "
            f"checkpoint. Written to DIR/{pins.PINS_DIRNAME}/ and appended, with who and why, to "
            f"DIR/{pins.PINS_DIRNAME}/{pins.JOURNAL_NAME}."
            + (" The step must be a consistent checkpoint." if name == "pin" else ""),
        )
        p.add_argument("dir", metavar="DIR", type=Path, help="the checkpoint directory")
        p.add_argument("--step", type=step_number, required=True, help=f"the step to {name}")
        p.add_argument("--reason", default="", type=_reason, help="why (recorded with the pin and in the journal)")
        p.add_argument("--json", action="store_true", help="print the pin as one JSON object")
        p.set_defaults(handler=handler)


def cmd_pin(args: argparse.Namespace) -> int:
    root = checkpoint_root(args.dir)
    done = pins.pin(root, args.step, who=pins.operator(), reason=args.reason, now=time.time())
    _log("checkpoint_pinned", done, root)
    if args.json:
        print_json(done.to_json())
    else:
        print(
            f"pinned step {done.step} under {root}: retention keeps it until `ftsup ckpt unpin {root} --step "
            f"{done.step}`"
        )
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace) -> int:
    root = checkpoint_root(args.dir)
    old = pins.unpin(root, args.step, who=pins.operator(), reason=args.reason, now=time.time())
    _log("checkpoint_unpinned", pins.Pin(old.step, pins.operator(), args.reason, time.time()), root)
    if args.json:
        print_json(old.to_json())
    else:
        why = f": {old.reason}" if old.reason else ""
        print(f"unpinned step {old.step} under {root} (pinned by {old.who}{why})")
    return EXIT_OK


def _log(event: str, pin: pins.Pin, root: Path) -> None:
    if not structlog.is_configured():  # a command of its own: JSON on stderr (on a terminal, the console's line)
        logs.configure()
    structlog.get_logger("ftsup").info(event, step=pin.step, who=pin.who, reason=pin.reason, path=str(root))


def _reason(text: str) -> str:
    if len(text) > pins.MAX_TEXT_CHARS:
        raise argparse.ArgumentTypeError(f"at most {pins.MAX_TEXT_CHARS} characters, got {len(text)}")
    return text


def _pin_lines(pinset: pins.PinSet, steps: set[int]) -> list[str]:
    """Pins of steps with no checkpoint, and pin files that are not good pins: not checkpoints, worth seeing."""
    lines = [f"pinned, but no checkpoint: step {p.step} (by {p.who})" for p in pinset.pins if p.step not in steps]
    lines.extend(f"bad pin: {p}" for p in pinset.problems)
    if not pinset.readable:
        lines.append("retention deletes no checkpoint until the pins can be read")
    return lines


def print_verified(
    path: str,
    name: str,
    step: int | None,
    manifest: layout.Manifest | None,
    consistent: bool,
    problems: list[layout.Problem],
    args: argparse.Namespace,
    *,
    deep_means: str,
    described: layout.CheckpointInfo | None = None,
) -> None:
    """What `ftsup ckpt verify` found of one checkpoint, as JSON (`--json`) or text; `described`, where given, is
    what kind, world size and creation time are read from (else the manifest)."""
    if args.json:
        about: Any = described if described is not None else manifest
        print_json(
            {
                "path": path,
                "step": step,
                "consistent": consistent,
                "deep": args.deep,
                "problems": [{"file": p.file, "reason": p.reason} for p in problems],
                "kind": about.kind if about else None,
                "world_size": about.world_size if about else None,
                "created_unix": about.created_unix if about else None,
                "files": len(manifest.files) if manifest else None,
                "bytes": sum(e.size for e in manifest.files.values()) if manifest else None,
            }
        )
    elif manifest is not None and consistent:
        total = sum(e.size for e in manifest.files.values())
        how = deep_means if args.deep else "sizes checked; --deep verifies checksums"
        print(
            f"{name}: consistent ({manifest.kind}, world size {manifest.world_size}, "
            f"{len(manifest.files)} files, {human_bytes(total)}; {how})"
        )
    else:
        print(f"{name}: NOT consistent ({len(problems)} problem(s)):")
        for p in problems:
            print(f"  {p}")


def cmd_verify(args: argparse.Namespace) -> int:
    if _is_tier(args.dir):
        return _verify_tier(args)
    root = checkpoint_root(args.dir)
    committed = dict(layout.committed_dirs(root))
    if args.step is None:
        if not committed:
            raise NoCheckpointError(f"no committed checkpoint under {root}")
        path = committed[max(committed)]
    elif args.step in committed:
        path = committed[args.step]
    else:
        raise NoCheckpointError(no_step_message(root, args.step))

    manifest, problems = layout.check_checkpoint(path, deep=args.deep)
    if manifest is not None and not problems:  # what the loader checks besides: where each chunk's bytes are
        problems = dcpmeta.problems(manifest, lambda: dcpmeta.read(path, manifest))
    consistent = manifest is not None and not problems
    step = manifest.step if manifest else layout.parse_step_dirname(path.name)
    print_verified(str(path), path.name, step, manifest, consistent, problems, args, deep_means="checksums verified")
    if not consistent and not args.json:
        if args.step is None:
            fallback = layout.latest_consistent(root, below=step)
            print(
                f"the newest older checkpoint passing the fast check is step {fallback.step}"
                if fallback
                else "no older checkpoint passes the fast check either"
            )
    return EXIT_OK if consistent else EXIT_PROBLEM


def checkpoint_root(path: Path) -> Path:
    if not path.exists():
        raise UsageError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise UsageError(f"{path} is not a directory")
    return path


def no_step_message(root: Path, step: int) -> str:
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
        elif saving.parse_staging_name(p.name) is not None:
            lines.append(f"not committed: {p.name} (a save starting, or one a crash cut short)")
        elif p.name.startswith("step-") and ".corrupt" in p.name:
            lines.append(f"quarantined: {p.name}")
        elif p.name.startswith("step-") and ".abandoned" in p.name:
            lines.append(f"abandoned by a rollback: {p.name} (kept; no run resumes from it)")
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


def checkpoint_table(infos: Sequence[layout.CheckpointInfo], pinned: frozenset[int] = frozenset()) -> str:
    rows = [("STEP", "KIND", "WORLD", "CREATED (UTC)", "STATUS", "PIN", "PATH")]
    for i in infos:
        rows.append(
            (
                str(i.step),
                i.kind or "-",
                str(i.world_size) if i.world_size is not None else "-",
                utc(i.created_unix),
                "ok" if i.consistent else "INCONSISTENT",
                "pinned" if i.step in pinned else "-",
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


def utc(created_unix: float | None) -> str:
    if created_unix is None:
        return "-"
    return datetime.fromtimestamp(created_unix, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


# --------------------------------------------------------------------------- a durable tier on object storage


def _is_tier(location: object) -> bool:
    """Whether a DIR argument names a durable tier on object storage rather than a directory."""
    return isinstance(location, str) and location.startswith("s3://")


def _list_tier(args: argparse.Namespace) -> int:
    with durable.open_tier(args.dir) as tier, tier.deadline(args.timeout):
        listed = tier.list_checkpoints(deep=args.deep)
    infos = listed.checkpoints
    if args.json:
        rows = [{**i.to_json(), "pinned": False, "pin": None} for i in infos]
        out: dict[str, Any] = {"checkpoints": rows}
        if listed.others:
            out["others"] = listed.others
        print_json(out)
        return EXIT_OK
    if not infos:
        print(f"no committed checkpoints under {tier.url}")
    else:
        print(checkpoint_table(infos))
        broken = sum(not i.consistent for i in infos)
        check = "deep check (checksums, read back)" if args.deep else "fast check (sizes; --deep: checksums)"
        print(f"\n{len(infos)} committed, {broken} inconsistent; {check}")
    for other in listed.others:
        print(f"not a checkpoint: {other}")
    return EXIT_OK


def _verify_tier(args: argparse.Namespace) -> int:
    with durable.open_tier(args.dir) as tier, tier.deadline(args.timeout):
        step = args.step
        if step is None:
            committed = tier.committed_steps()
            if not committed:
                raise NoCheckpointError(f"no committed checkpoint under {tier.url}")
            step = max(committed)
        info = tier.inspect(step, deep=args.deep)
        try:
            manifest: layout.Manifest | None
            manifest, raw = tier.manifest(step)
        except CheckpointError:
            manifest = None
        if info.consistent and manifest is not None:  # what the loader checks besides, as it reads it
            pick = tiers.DurablePick(info, manifest, raw)
            problems = dcpmeta.problems(manifest, lambda: tiers.read_dcp_metadata(tier, pick))
            info = dataclasses.replace(info, consistent=not problems, problems=tuple(problems))
    print_verified(
        info.path,
        layout.step_dirname(step),
        step,
        manifest,
        info.consistent,
        list(info.problems),
        args,
        deep_means="checksums verified, every byte read back",
        described=info,
    )
    return EXIT_OK if info.consistent else EXIT_PROBLEM
