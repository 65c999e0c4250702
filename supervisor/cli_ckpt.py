"""`ftsup ckpt list` and `ftsup ckpt verify`: what a checkpoint store holds, as a table or as JSON.

Part of the `ftsup` command line (`ftsup.supervisor.cli` registers the commands and their flags; the exit
statuses are its). Torch-free: it prints what `ftsup.store.layout` finds and decides nothing itself.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ftsup.store import layout
from ftsup.store.errors import NoCheckpointError
from ftsup.supervisor.errors import UsageError

EXIT_OK = 0
EXIT_PROBLEM = 1


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def cmd_list(args: argparse.Namespace) -> int:
    root = _checkpoint_root(args.dir)
    infos = layout.list_checkpoints(root, deep=args.deep)
    if args.json:
        print_json({"checkpoints": [info.to_json() for info in infos]})
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


def cmd_verify(args: argparse.Namespace) -> int:
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
        print_json(
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
