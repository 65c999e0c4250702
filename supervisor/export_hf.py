"""`ftsup ckpt export-hf`: its flags and what it prints. Torch-free, like the rest of the CLI.

The export itself (verified reads, safetensors shards, the Trainer's files, `config.json`) is
`ftsup.trainer.checkpoint.hf`, which needs torch: `ftsup.supervisor.cli` imports it when the
command runs and hands it to `run`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ftsup.supervisor.errors import UsageError

DESCRIPTION = (
    "Write OUT/model-0000k-of-0000n.safetensors, OUT/model.safetensors.index.json and OUT/config.json from "
    "checkpoint --step (default: the latest consistent one), whatever world size saved it, so that "
    "AutoModelForCausalLM.from_pretrained(OUT) loads it. config.json is the model config the checkpoint holds, "
    "or --config FILE. The checkpoint is deep-verified first; OUT must not exist or be empty."
)
DEFAULT_SHARD_BYTES = 5 * 10**9
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20,
               "GIB": 1 << 30, "TIB": 1 << 40}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser, step: Any) -> None:
    """`step`: the CLI's parser of a step number (one definition for every command)."""
    p.add_argument("dir", metavar="DIR", type=Path, help="the checkpoint directory")
    p.add_argument("--step", type=step, help="the step to export (default: latest consistent)")
    p.add_argument("out", metavar="OUT", type=Path, help="the output directory")
    p.add_argument("--prefix", help="key prefix of the model's tensors (default: found automatically)")
    p.add_argument("--config", metavar="FILE", type=Path, help="the model's config.json (default: the checkpoint's)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--max-shard-size", metavar="SIZE", type=byte_size, dest="max_shard_bytes",
                      help="largest file size, e.g. 5GB or 500MB (default 5GB)")  # fmt: skip
    size.add_argument("--max-shard-gb", type=float, help="largest file size in GB (the same, in GB)")


def run(args: argparse.Namespace, hf: Any) -> int:
    """Export with `hf` (the module `ftsup.trainer.checkpoint.hf`) and say what was written."""
    max_bytes = args.max_shard_bytes or int(
        DEFAULT_SHARD_BYTES if args.max_shard_gb is None else args.max_shard_gb * 1e9
    )
    if max_bytes < 1:
        raise UsageError("--max-shard-gb: a shard must hold at least 1 byte")
    config = hf.read_config_file(args.config) if args.config is not None else None
    index = hf.export_hf(args.dir, args.step, args.out, prefix=args.prefix, max_shard_bytes=max_bytes, config=config)
    files = sorted(set(index["weight_map"].values()))
    meta = index["metadata"]
    print(f"exported step {meta['ftsup_step']}: {len(index['weight_map'])} tensors, "
          f"{meta['total_size']} bytes in {len(files)} file(s) under {args.out}")  # fmt: skip
    if meta.get("config") is None:
        print(f"ftsup: note: no config.json written (the checkpoint holds no transformers model config); pass "
              f"--config FILE so that from_pretrained({str(args.out)!r}) can load it", file=sys.stderr)  # fmt: skip
    return 0


def byte_size(text: str) -> int:
    """A size as transformers spells one: a number of bytes, or with a unit (5GB, 500MB, 2GiB)."""
    t = text.strip()
    digits = len(t) - len(t.lstrip("0123456789."))
    number, unit = t[:digits], t[digits:].strip().upper()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if value < 0 or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a number of bytes, or with a unit: 5GB, 500MB, 2GiB)")
    n = int(value * _SIZE_UNITS[unit])
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard must hold at least 1 byte")
    return n
