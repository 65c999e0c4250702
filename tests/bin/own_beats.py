"""A script that already uses ftsup: it asks for ftsup's runtime client and beats each optimizer step itself, counted
from 1000, so that a test can tell its beats from the auto-instrumentation's (which must stand down).

    own_beats.py --steps N
"""

from __future__ import annotations

import argparse

import torch

from ftsup import runtime

OFFSET = 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    a = p.parse_args()
    rt = runtime()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, a.steps + 1):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        rt.beat(OFFSET + step, "train")


if __name__ == "__main__":
    main()
