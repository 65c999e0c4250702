"""`ftsup ckpt export-hf`: its flags and what it prints. Torch-free, like the rest of the CLI: the export itself is
`ftsup.trainer.hf.export`, which needs torch, imported by `cli.commands` when the command runs and handed to `run`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ftsup.store import dtypes, hublayout
from ftsup.supervisor.errors import UsageError

VERIFIED = (
    "Every byte exported is verified against the checkpoint's checksums as it is read; OUT must not exist or be "
    "empty, and appears only when complete."
)
"""What every export promises, the end of its --help."""
DESCRIPTION = (
    "Write the model of checkpoint --step (default: the latest consistent one), whatever world size saved it, as "
    "huggingface_hub's save_torch_state_dict writes one: OUT/model.safetensors, or past --max-shard-size "
    "OUT/model-0000k-of-0000n.safetensors and OUT/model.safetensors.index.json; and OUT/config.json, so that "
    "AutoModelForCausalLM.from_pretrained(OUT) loads it. config.json is the model config the checkpoint holds, or "
    f"--config FILE. {VERIFIED}"
)


def add_source_arguments(p: argparse.ArgumentParser, step: Any) -> None:
    """DIR, --step and OUT, as every export takes them; `step`: the CLI's parser of a step number (one definition
    for every command)."""
    p.add_argument("dir", metavar="DIR", type=Path, help="the checkpoint directory")
    p.add_argument("--step", type=step, help="the step to export (default: latest consistent)")
    p.add_argument("out", metavar="OUT", type=Path, help="the output directory")


def add_arguments(p: argparse.ArgumentParser, step: Any) -> None:
    """`step`: the CLI's parser of a step number (one definition for every command)."""
    add_source_arguments(p, step)
    p.add_argument("--prefix", help="key prefix of the model's tensors (default: found automatically)")
    p.add_argument("--config", metavar="FILE", type=Path, help="the model's config.json (default: the checkpoint's)")
    p.add_argument(
        "--dtype",
        choices=sorted(dtypes.CAST_NAMES),
        help="the floating tensors (float64/32/16, bfloat16) in this dtype; others as saved",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=byte_size,
        dest="max_shard_bytes",
        help="largest file, as the Hub spells it: 5GB, 500MB, 2GiB or bytes (default 5GB)",
    )
    size.add_argument("--max-shard-gb", type=float, help="largest file size in GB (the same, in GB)")


def run(args: argparse.Namespace, hf: Any, err: TextIO | None = None) -> int:
    """Export with `hf` (the module `ftsup.trainer.hf.export`) and say what was written; progress on
    `err` (stderr) when it is a terminal."""
    err = sys.stderr if err is None else err
    max_bytes = args.max_shard_bytes or int(
        hublayout.DEFAULT_MAX_SHARD_BYTES if args.max_shard_gb is None else args.max_shard_gb * 1e9
    )
    if max_bytes < 1:
        raise UsageError("--max-shard-gb: a shard must hold at least 1 byte")
    config = hf.read_config_file(args.config) if args.config is not None else None
    dtype = None if args.dtype is None else hf.torch_dtype(dtypes.CAST_NAMES[args.dtype])
    index = hf.export_hf(
        args.dir,
        args.step,
        args.out,
        prefix=args.prefix,
        max_shard_bytes=max_bytes,
        config=config,
        dtype=dtype,
        progress=progress_printer(err),
    )
    files = sorted(set(index["weight_map"].values()))
    meta = index["metadata"]
    print(
        f"exported step {meta['ftsup_step']}: {len(index['weight_map'])} tensors, "
        f"{meta['total_size']} bytes in {len(files)} file(s) under {args.out}"
    )
    if meta.get("config") is None:
        print(
            f"ftsup: note: no config.json written (the checkpoint holds no transformers model config); pass "
            f"--config FILE so that from_pretrained({str(args.out)!r}) can load it",
            file=err,
        )
    return 0


def progress_printer(
    stream: TextIO, clock: Callable[[], float] = time.monotonic, every_s: float = 0.2
) -> Callable[[int, int], None] | None:
    """A `progress(done, total)` that redraws one line on `stream` at most every `every_s` (and at the end);
    None when `stream` is not a terminal: a log or a pipe gets only the summary."""
    if not stream.isatty():
        return None
    last = [-math.inf]

    def show(done: int, total: int) -> None:
        now = clock()
        if done < total and now - last[0] < every_s:
            return
        last[0] = now
        pct = 100 * done // total if total else 100
        stream.write(f"\rexporting: {done / 1e9:.2f} of {total / 1e9:.2f} GB ({pct}%)")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return show


def byte_size(text: str) -> int:
    """A size as the Hub's tools spell one (`ftsup.store.hublayout.parse_size`), for argparse."""
    try:
        return hublayout.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
