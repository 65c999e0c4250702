"""What the `ftsup bench` commands share: their argument types, their output flags and the spread of a figure."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def positive(text: str) -> int:
    """An argument that is a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def seconds(text: str) -> float:
    """An argument that is a number of seconds above 0 and finite."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < x < 1e7:
        raise argparse.ArgumentTypeError(f"must be above 0 and finite, got {text}")
    return x


def add_output(p: argparse.ArgumentParser, *, work_dir: bool = True) -> None:
    """`--json FILE` and (with `work_dir`) `--dir DIR`, as every benchmark that runs jobs takes them."""
    p.add_argument("--json", type=Path, metavar="FILE", help="write the results as one JSON object to FILE")
    if work_dir:
        p.add_argument("--dir", type=Path, metavar="DIR", help="work directory (default: a fresh temporary directory)")


def spread(values: list[float]) -> dict[str, float]:
    """Median and the 10th and 90th percentiles of `values` (at least one)."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"median": statistics.median(ordered), "p10": at(0.1), "p90": at(0.9)}
