"""`ftsup ckpt import-deepspeed`: its flags and what it prints. Torch-free, like the rest of the CLI: the conversion is
`ftsup.trainer.deepspeed.convert`, which needs torch, imported by `cli.commands` when the command runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from ftsup.store import hublayout
from ftsup.supervisor.cli.export_hf import byte_size, progress_printer

DESCRIPTION = (
    "Write the fp32 weights of a DeepSpeed ZeRO (stage 1-3) checkpoint, consolidated as DeepSpeed's zero_to_fp32 "
    "consolidates them, in the Hugging Face Hub's layout (OUT/model.safetensors, or shards and an index past "
    "--max-shard-size), one tensor in memory at a time. DIR: a DeepSpeed save directory (the tag --tag, else the one "
    "`latest` names when it is whole, else the newest whole global_stepN), a tag's own directory (an ftsup store's "
    "step-N of a DeepSpeed job), or that store itself (its newest consistent checkpoint). Every file is read without "
    "running its pickle; OUT must not exist or be empty, and appears only when complete. A run starts from OUT with "
    "init_from_hf (docs/deepspeed.md)."
)


def add_arguments(p: argparse.ArgumentParser, step: Any = None) -> None:
    """Its flags (`step`, the step-number type the export commands take, is not one of them: a DeepSpeed save is
    named by its tag)."""
    p.add_argument("dir", metavar="DIR", type=Path, help="a DeepSpeed save directory, or one tag's directory")
    p.add_argument("out", metavar="OUT", type=Path, help="the output directory")
    p.add_argument("--tag", help="the tag to convert (default: `latest` when whole, else the newest whole)")
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=byte_size,
        dest="max_shard_bytes",
        default=hublayout.DEFAULT_MAX_SHARD_BYTES,
        help="largest file, as the Hub spells it: 5GB, 500MB, 2GiB or bytes (default 5GB)",
    )


def run(args: argparse.Namespace, convert: Any, err: TextIO | None = None) -> int:
    err = sys.stderr if err is None else err
    index = convert.import_deepspeed(
        args.dir, args.out, tag=args.tag, max_shard_bytes=args.max_shard_bytes, progress=progress_printer(err)
    )
    meta = index["metadata"]
    files = sorted(set(index["weight_map"].values()))
    print(
        f"converted {meta['deepspeed_tag']} (ZeRO stage {meta['zero_stage']}, step {meta['step']}): "
        f"{len(index['weight_map'])} tensors, {meta['total_size']} bytes in {len(files)} file(s) under {args.out}"
    )
    return 0
