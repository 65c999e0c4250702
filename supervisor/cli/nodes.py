"""`ftsup nodes --config JOB.yaml [--json]`: this node's health as last checked, whether it waits and why, a hot
spare's wait, and its quarantine; `ftsup nodes clear NODE|--all [--slot N]` lets a quarantined node in again
(docs/cli.md, `ftsup nodes`). Every file read is hostile input; nothing but a clear changes anything.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from pathlib import Path
from typing import Any

from ftsup.store.pins import operator
from ftsup.supervisor import statedir
from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.errors import UsageError
from ftsup.supervisor.policy import nodes
from ftsup.supervisor.state import nodes as nodefiles

CLEAR_WAIT_S = 5.0  # how long `clear` waits to see a running supervisor serve its request


def utc(t: object) -> str:
    if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t < 253402300800:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "This node's health as its supervisor last checked it before an attempt, why its next attempt waits (a "
        "failed check, a quarantine), a hot spare's wait in the rendezvous, and the failures put on the node and "
        "its slots. `clear` ends the node's quarantine and forgets its failures."
    )
    p.add_argument("--config", type=Path, metavar="JOB.yaml", help="the node's job config (required)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_nodes)
    actions = p.add_subparsers(dest="nodes_command", metavar="ACTION")
    c = actions.add_parser("clear", help="let a quarantined node in again; its failures are forgotten")
    c.add_argument("node", nargs="?", metavar="NODE", help="the node (launch.node_id) whose quarantine ends")
    c.add_argument("--all", action="store_true", help="every target of this node: the node and its slots")
    c.add_argument("--slot", type=int, action="append", metavar="N", help="only slot N's failures (may repeat)")
    c.add_argument("--config", dest="clear_config", type=Path, metavar="JOB.yaml", help="the node's job config")
    c.set_defaults(handler=cmd_clear)


def gather(state_dir: Path, node_id: str, now: float) -> dict[str, Any]:
    """The node as one JSON-ready object; a file that cannot be used is said so in `problems` and left out."""
    problems: list[str] = []
    view = book = None
    try:
        view = nodefiles.read_view(state_dir / nodefiles.VIEW)
    except nodefiles.NodeFileError as e:
        problems.append(str(e))
    try:
        book = nodefiles.read(state_dir / nodefiles.QUARANTINE)
    except nodefiles.NodeFileError as e:
        problems.append(str(e))
    book = book or nodes.Book()
    held = nodes.held(book, now)
    return {
        "node_id": node_id,
        "checked_unix": view.checked_unix if view else None,
        "healthy": view.verdict.healthy if view else None,
        "checks": [{"check": c.name, "result": c.result, "detail": c.detail} for c in view.verdict.checks]
        if view
        else [],
        "waiting": view.deferred if view else None,
        "retry_unix": view.retry_unix if view else None,
        "standby": view.standby if view else None,
        "quarantined": held is not None,
        "quarantined_until_unix": held.until if held else None,
        "targets": [
            {
                "target": e.target,
                "failures_unix": list(e.faults),
                "until_unix": e.until if e.until is not None and e.until > now else None,
                "reason": e.reason,
                "quarantines": e.quarantines,
            }
            for e in book.entries
        ],
        "problems": problems,
    }


def lines(node: dict[str, Any], indent: str = "") -> list[str]:
    """`node` (`gather`) as text."""
    health = {True: "healthy", False: "unhealthy", None: "not known"}[node["healthy"]]
    out = [f"{indent}node {node['node_id']}: {health if node['checked_unix'] is not None else 'not checked yet'}"]
    if node["checked_unix"] is not None:
        out[0] += f" (checked {utc(node['checked_unix'])})"
        shown = ", ".join(
            f"{c['check']} {c['result']}" + (f" ({c['detail']})" if c["detail"] else "") for c in node["checks"]
        )
        out.append(f"{indent}  checks: {shown}")
    if node["standby"] == "waiting":
        out.append(f"{indent}  hot spare: waiting in the rendezvous for a free slot")
    elif node["standby"] == "joined":
        out.append(f"{indent}  hot spare: joined the job")
    if node["quarantined"]:
        out.append(f"{indent}  quarantined until {utc(node['quarantined_until_unix'])}: `ftsup nodes clear` ends it")
    for t in node["targets"]:
        counted = f"{len(t['failures_unix'])} failure(s) counted, quarantined {t['quarantines']} time(s)"
        out.append(f"{indent}  {t['target']}: {counted}; last: {t['reason']}")
    if node["waiting"]:
        out.append(f"{indent}  next attempt waits: {node['waiting']} (asks again {utc(node['retry_unix'])})")
    out += [f"{indent}  ignored: {p}" for p in node["problems"]]
    return out


def _config(args: argparse.Namespace) -> Path:
    path: Path | None = getattr(args, "clear_config", None) or args.config
    if path is None:
        raise UsageError("--config JOB.yaml is required: the config of the node to look at")
    return path


def cmd_nodes(args: argparse.Namespace) -> int:
    cfg = load_config(_config(args))
    node = gather(Path(cfg.job.state_dir), cfg.launch.node_id, time.time())
    if args.json:
        print(json.dumps({"nodes": [node]}, indent=2))
    else:
        print("\n".join(lines(node)))
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    cfg = load_config(_config(args))
    node_id = cfg.launch.node_id
    if args.all == (args.node is not None):
        raise UsageError("name the node to clear (NODE) or give --all")
    if args.node is not None and args.node != node_id:
        raise UsageError(f"{_config(args)} is node {node_id!r}, not {args.node!r}: give that node's config")
    slots = tuple(args.slot) if args.slot else None
    if slots is not None and any(s < 0 or s >= nodefiles.MAX_SLOT for s in slots):
        raise UsageError(f"--slot must be a slot number from 0 to {nodefiles.MAX_SLOT - 1}")
    state_dir = statedir.ensure_dir(cfg.job.state_dir, "job.state_dir")
    req = nodefiles.ClearRequest(secrets.token_hex(8), slots, operator(), time.time())
    what = "its slots " + ", ".join(map(str, slots)) if slots else "its quarantine and failures"
    try:
        lock = statedir.InstanceLock(state_dir)
    except UsageError:  # a supervisor runs this node (it holds the lock): it serves the request
        return _ask(state_dir, req, node_id, what)
    try:  # no supervisor runs here: the journal is ours to change, under its lock
        path = state_dir / nodefiles.QUARANTINE
        try:
            book = nodefiles.read(path) or nodes.Book()
        except nodefiles.NodeFileError as e:
            raise UsageError(f"{e}; move it away to start the node with no quarantine") from None
        book, gone = nodes.clear(book, req.id, slots)
        nodefiles.write(path, book, node_id, time.time())
    finally:
        lock.close()
    print(
        f"node {node_id}: cleared {', '.join(gone) or 'nothing (none was kept)'}; the next `ftsup run` launches on it"
    )
    return 0


def _ask(state_dir: Path, req: nodefiles.ClearRequest, node_id: str, what: str) -> int:
    statedir.write_atomic(state_dir / nodefiles.CLEAR, req.encode())
    deadline = time.monotonic() + CLEAR_WAIT_S
    while time.monotonic() < deadline:
        try:
            book = nodefiles.read(state_dir / nodefiles.QUARANTINE)
        except nodefiles.NodeFileError:
            book = None
        if book is not None and req.id in book.served:
            print(f"node {node_id}: {what} cleared by its supervisor (request {req.id})")
            return 0
        time.sleep(0.1)  # a poll under a deadline: the supervisor looks at the request every half second
    print(f"node {node_id}: clear requested (request {req.id}); its supervisor has not served it yet")
    return 1
