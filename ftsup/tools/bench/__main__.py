"""`python -m ftsup.tools.bench checkpoint|scale ...`: the same as `ftsup bench checkpoint|scale ...`."""

from __future__ import annotations

import argparse
import sys

from ftsup.tools.bench.checkpoint import command as checkpoint
from ftsup.tools.bench.scale import command as scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftsup.tools.bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    checkpoint.add_arguments(sub.add_parser("checkpoint", help="checkpoint save/load benchmark"))
    scale.add_arguments(sub.add_parser("scale", help="metadata costs at N simulated ranks"))
    args = parser.parse_args(argv)
    return scale.run(args) if args.bench == "scale" else checkpoint.run(args)


if __name__ == "__main__":
    sys.exit(main())
