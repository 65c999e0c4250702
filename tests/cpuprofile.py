"""Where the suite's CPU goes: `-p tests.cpuprofile --cpu-log FILE` records each test's CPU time, its own and its
reaped children's (torchrun, ranks, supervisors), one JSON line per test; `python -m tests.cpuprofile FILE` sums
them by module, or with `--procs` a `FTSUP_TEST_PROC_LOG` file by kind of process (docs/testing.md, Where the time
goes)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-log", default=None, help="append each test's CPU seconds to this file (JSON lines)")


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    path = item.config.getoption("--cpu-log")
    if path is None:
        yield
        return
    t0, (own0, kids0) = time.monotonic(), _cpu()
    yield
    own, kids = _cpu()
    line = {"id": item.nodeid, "own_s": own - own0, "children_s": kids - kids0, "wall_s": time.monotonic() - t0}
    line["end"] = time.time()  # with the worker's name, the suite's timeline: how busy each worker was when
    line["worker"] = os.environ.get("PYTEST_XDIST_WORKER", "")
    line["load"] = os.getloadavg()[0]
    with open(path, "a") as f:  # one write per line, appended: the workers of pytest-xdist share the file
        f.write(json.dumps(line) + "\n")


def by_module(lines: list[dict[str, Any]]) -> list[tuple[str, float, float, int]]:
    """(module, CPU seconds, wall seconds, tests), most CPU first. A module-scoped fixture counts in its first test;
    a process still running when its test ends (a session's S3 server) counts nowhere."""
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for line in lines:
        module = line["id"].split("::")[0]
        cpu[module] += line["own_s"] + line["children_s"]
        wall[module] += line["wall_s"]
        count[module] += 1
    return sorted(((m, cpu[m], wall[m], count[m]) for m in cpu), key=lambda r: -r[1])


def kind(argv: list[str]) -> str:
    """What a process of the suite was, from its command line: `-m MODULE` (with the CLI's subcommand), a
    script's file name, or `-c`."""
    args = list(argv)
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):  # the interpreter's own options
        args = args[2:] if args[0] in ("-X", "-W") else args[1:]
    if not args:
        return "python"
    if args[0] == "-m" and len(args) > 1:
        sub = args[2] if len(args) > 2 and args[1].endswith(".cli") and not args[2].startswith("-") else ""
        return f"-m {args[1]} {sub}".rstrip()
    if args[0] == "-c":
        return "-c"
    name = os.path.basename(args[0])
    return f"{name} {args[1]}" if name == "warmrun.py" and len(args) > 1 else name


def by_kind(lines: list[dict[str, Any]]) -> list[tuple[str, float, int]]:
    """(kind of process, CPU seconds, processes), most CPU first, from a `FTSUP_TEST_PROC_LOG` file."""
    cpu: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for line in lines:
        k = kind(line["argv"])
        cpu[k] += line["cpu_s"]
        count[k] += 1
    return sorted(((k, cpu[k], count[k]) for k in cpu), key=lambda r: -r[1])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.cpuprofile", description="Sum a --cpu-log file by test module.")
    p.add_argument("log", help="the file --cpu-log wrote (with --procs: the file FTSUP_TEST_PROC_LOG named)")
    p.add_argument("--top", type=int, default=30, help="how many modules to list (default 30)")
    p.add_argument("--procs", action="store_true", help="the log is FTSUP_TEST_PROC_LOG's: sum it by process kind")
    args = p.parse_args(argv)
    with open(args.log) as f:
        lines = [json.loads(text) for text in f if text.strip()]
    if args.procs:
        kinds = by_kind(lines)
        print(f"{len(lines)} processes, {sum(r[1] for r in kinds):.0f} CPU-s")
        print(f"{'CPU-s':>8} {'procs':>6} {'each':>6}  kind")
        for name, cpu, count in kinds[: args.top]:
            print(f"{cpu:8.1f} {count:6d} {cpu / count:6.2f}  {name}")
        return 0
    rows = by_module(lines)
    total = sum(r[1] for r in rows)
    print(f"{len(lines)} tests, {total:.0f} CPU-s, {sum(r[2] for r in rows):.0f} s of test time")
    print(f"{'CPU-s':>8} {'share':>6} {'wall s':>8} {'tests':>6}  module")
    for module, cpu, wall, count in rows[: args.top]:
        print(f"{cpu:8.1f} {cpu / max(total, 1e-9):6.1%} {wall:8.1f} {count:6d}  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
