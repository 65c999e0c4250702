"""`ftsup ckpt export-dcp`: its flags and what it prints. Torch-free, like the rest of the CLI: the export itself is
`ftsup.trainer.dcp.export`, which needs torch, imported by `cli.commands` when the command runs and handed to `run`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from ftsup.supervisor.cli.export_hf import VERIFIED, add_source_arguments, progress_printer

DESCRIPTION = (
    "Write every tensor of checkpoint --step (default: the latest consistent one), whatever world size saved it, as "
    "torch.distributed.checkpoint.save writes a state dict: OUT/.metadata and OUT/__0_0.distcp, each tensor under "
    "its name in the checkpoint (ftsup ckpt show lists them; --prefix P: only those under P, without it), so that "
    "torch.distributed.checkpoint.load loads it on any number of ranks (torchtitan's checkpoint.initial_load_path "
    f"reads it too). {VERIFIED}"
)


def add_arguments(p: argparse.ArgumentParser, step: Any) -> None:
    """`step`: the CLI's parser of a step number (one definition for every command)."""
    add_source_arguments(p, step)
    p.add_argument(
        "--prefix",
        default="",
        help="only the tensors whose names start with P, written without it (train.model.: the reference trainer's "
        "model under its own names, as torchtitan loads one)",
    )


def run(args: argparse.Namespace, dcp: Any, err: TextIO | None = None) -> int:
    """Export with `dcp` (the module `ftsup.trainer.dcp.export`) and say what was written; progress on `err`
    (stderr) when it is a terminal."""
    err = sys.stderr if err is None else err
    got = dcp.export_dcp(args.dir, args.step, args.out, prefix=args.prefix, progress=progress_printer(err))
    print(f"exported step {got['step']}: {got['tensors']} tensors, {got['bytes']} bytes of them under {args.out}")
    return 0
