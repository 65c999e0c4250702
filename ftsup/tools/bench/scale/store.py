"""The store side of `ftsup bench scale`, torch-free: what reading a store of N-rank checkpoints costs, through the
product's own code (the manifest's parse, the fast verify, the supervisor's resume choice and refresh, `ftsup ckpt
list`). Run as `python -m ftsup.tools.bench.scale.store` by `child`, which never imports the supervisor; writes its
measurements as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftsup.store import layout
from ftsup.supervisor.cli import ckpt as cli_ckpt
from ftsup.supervisor.state.ckptstore import StoreScanner


def newest(root: Path) -> Path:
    return layout.committed_dirs(root)[-1][1]


def manifest_parse(root: Path) -> Callable[[], Any]:
    path = newest(root) / layout.MANIFEST_NAME
    raw = path.read_bytes()
    return lambda: layout.parse_manifest(raw, str(path))


def manifest_read(root: Path) -> Callable[[], Any]:
    path = newest(root)
    return lambda: layout.read_manifest(path)


def fast_verify(root: Path) -> Callable[[], Any]:
    path = newest(root)

    def run() -> None:
        manifest, problems = layout.check_checkpoint(path)
        if manifest is None or problems:
            raise RuntimeError(f"{path} does not verify: {problems[:3]}")

    return run


def resume_choice(root: Path) -> Callable[[], Any]:
    """The supervisor's resume choice, made on the caller's thread (the scanner is not started)."""

    def run() -> None:
        resume = StoreScanner(root).choose(timeout_s=600.0)
        if resume.picked.info is None or resume.picked.passed:
            raise RuntimeError(f"the resume choice over {root} found no consistent checkpoint: {resume.error}")

    return run


def ckpt_list(root: Path) -> Callable[[], Any]:
    """`ftsup ckpt list DIR` (its table to a string, not the terminal)."""
    args = argparse.Namespace(dir=root, deep=False, json=False)

    def run() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            if cli_ckpt.cmd_list(args) != cli_ckpt.EXIT_OK:
                raise RuntimeError(f"ftsup ckpt list {root} failed")

    return run


def refresh_new(root: Path, recent: int) -> Callable[[], Any]:
    """A refresh that finds the newest checkpoint new (a fresh scanner each time: nothing cached)."""

    def run() -> None:
        scanner = StoreScanner(root, recent=recent)
        scanner.scan()
        _checked(scanner)

    return run


def refresh_unchanged(root: Path, recent: int) -> Callable[[], Any]:
    """A refresh of a store the previous one saw as it is (the daemon's case between two saves)."""
    scanner = StoreScanner(root, recent=recent)
    scanner.scan()
    _checked(scanner)

    def run() -> None:
        scanner.scan()

    return run


def _checked(scanner: StoreScanner) -> None:
    view = scanner.view()
    if view.latest is None or view.errors:
        raise RuntimeError(f"the refresh found no consistent checkpoint ({view.last_error})")


def main(argv: list[str] | None = None) -> int:
    from ftsup.tools.bench.scale.measure import measure  # torch-free; one clock for both sides

    p = argparse.ArgumentParser(prog="python -m ftsup.tools.bench.scale.store")
    p.add_argument("--root", type=Path, required=True, help="a store of consistent checkpoints")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=20.0)
    p.add_argument("--recent", type=int, default=2, help="checkpoints the refresh checks (as the daemon's)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    root, reps, budget = args.root, args.repeats, args.budget
    ops = {
        "manifest_parse": measure(manifest_parse(root), reps, budget_s=budget),
        "fast_verify": measure(fast_verify(root), reps, budget_s=budget),
        "resume_choice": measure(resume_choice(root), reps, budget_s=budget),
        "ckpt_list": measure(ckpt_list(root), reps, budget_s=budget),
        "refresh_new": measure(refresh_new(root, args.recent), reps, budget_s=budget),
        "refresh_unchanged": measure(refresh_unchanged(root, args.recent), max(reps, 5), budget_s=budget),
    }
    args.out.write_text(json.dumps(ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
