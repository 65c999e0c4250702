"""A script without a line of ftsup that writes what it finds of the auto-instrumentation in its own process, as JSON
to OUT: the `sitecustomize` it runs under, whether `torch.nn.Module.train` is wrapped, and its PYTHONPATH once torch
is imported; then it steps an optimizer a few times.

    instrument_probe.py OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    site = sys.modules.get("sitecustomize")
    found = {
        "sitecustomize": getattr(site, "__file__", None),
        "wrapped": hasattr(torch.nn.Module.train, "__wrapped__"),
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    with open(sys.argv[1], "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main()
