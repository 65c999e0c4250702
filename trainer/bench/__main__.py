"""`python -m ftsup.trainer.bench checkpoint ...`: the same as `ftsup bench checkpoint ...`."""

from __future__ import annotations

import argparse
import sys

from ftsup.trainer.bench import add_checkpoint_arguments, run_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftsup.trainer.bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_checkpoint_arguments(sub.add_parser("checkpoint", help="checkpoint save/load benchmark"))
    args = parser.parse_args(argv)
    return run_checkpoint(args)


if __name__ == "__main__":
    sys.exit(main())
