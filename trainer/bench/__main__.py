"""`python -m ftsup.trainer.bench checkpoint|scale ...`: the same as `ftsup bench checkpoint|scale ...`."""

from __future__ import annotations

import argparse
import sys

from ftsup.trainer.bench import add_checkpoint_arguments, add_scale_arguments, run_checkpoint, run_scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftsup.trainer.bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_checkpoint_arguments(sub.add_parser("checkpoint", help="checkpoint save/load benchmark"))
    add_scale_arguments(sub.add_parser("scale", help="metadata costs at N simulated ranks"))
    args = parser.parse_args(argv)
    return run_scale(args) if args.bench == "scale" else run_checkpoint(args)


if __name__ == "__main__":
    sys.exit(main())
