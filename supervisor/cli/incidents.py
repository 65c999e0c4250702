"""`ftsup incidents [--config JOB.yaml] [--json]`, `ftsup incidents show ID`, `ftsup incidents capture`: the incident
records a job's supervisor kept (hangs, stragglers, captures asked for, anomalies), read as hostile input, and an
operator's request for a capture now (docs/cli.md, `ftsup incidents`). Torch-free; changes nothing but capture.json.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftsup.store.pins import operator
from ftsup.supervisor import statedir
from ftsup.supervisor.cli import status
from ftsup.supervisor.cli.ckpt import print_json
from ftsup.supervisor.errors import UsageError
from ftsup.supervisor.policy import stacks
from ftsup.supervisor.state import captures
from ftsup.supervisor.state.incidents import Incident, IncidentError, RankEvidence, Store

DESCRIPTION = (
    "List the incidents the supervisor of JOB.yaml kept in its state directory (hangs, stragglers, captures an "
    "operator asked for, anomalies), newest first; `show ID` prints one: the culprit rank and why, every rank's "
    "stacks (ranks with the same stacks together), their last heartbeats and log lines; `capture` asks the running "
    "supervisor for every rank's stacks now, stopping nothing. Without --config: the job of `ftsup run -- CMD` from "
    "this directory (state in ./.ftsup/<node>). A record that cannot be read is said in one line and skipped."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    _common(p, None)
    actions = p.add_subparsers(dest="incidents_command", metavar="ACTION", required=False)
    show = actions.add_parser("show", help="print one incident: the culprit, every rank's stacks, the last lines")
    show.add_argument("id", metavar="ID", help="the incident's id, as `ftsup incidents` lists it")
    _common(show, argparse.SUPPRESS)
    show.set_defaults(handler=cmd_show)
    cap = actions.add_parser("capture", help="ask the running supervisor for every rank's stacks now")
    cap.add_argument("--reason", default="", help="why, for the record and the log")
    _common(cap, argparse.SUPPRESS)
    cap.set_defaults(handler=cmd_capture)
    p.set_defaults(handler=cmd_list)


def _common(p: argparse.ArgumentParser, default: Any) -> None:
    """--config and --json, on the command and on each action (after the action's name too)."""
    p.add_argument("--config", type=Path, metavar="JOB.yaml", default=default, help="the job's YAML config")
    p.add_argument("--json", action="store_true", default=default, help="print one JSON object")


def state_dir(config: Path | None) -> Path:
    """The job's state directory: the config's `job.state_dir`, or that of `ftsup run -- CMD` from here."""
    from ftsup.supervisor.config import args as config_args

    cfg = config_args.load(config, None, None if config is not None else ["python"])
    return Path(cfg.job.state_dir)


def cmd_list(args: argparse.Namespace) -> int:
    store = Store(state_dir(args.config))
    found, problems = store.read_all()
    for line in problems:
        print(f"ftsup: {line}", file=sys.stderr)
    if args.json:
        print_json({"dir": str(store.dir), "incidents": [i.summary() for i in found], "problems": problems})
        return 0
    if not found:
        print(f"no incident recorded in {store.dir}")
        return 0
    rows = [("ID", "WHEN (UTC)", "TRIGGER", "EVENT", "ATTEMPT", "STEP", "CULPRIT", "CAPTURE", "WHY")]
    for i in found:
        took = f"{i.duration_s:.2f}s" if i.duration_s is not None else "-"
        culprit = f"rank {i.culprit}" if i.culprit is not None else "-"
        step = str(i.step) if i.step is not None else "-"
        rows.append((i.id, _when(i.created_unix), i.trigger, i.event, str(i.attempt), step, culprit, took, _why(i)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    store = Store(state_dir(args.config))
    try:
        incident = store.read(args.id)
    except IncidentError as e:
        raise UsageError(str(e)) from None
    if args.json:
        out = incident.to_json()
        out["groups"] = [{"ranks": list(r)} for r, _ in stacks.group((x.rank, x.threads) for x in incident.ranks)]
        print_json(out)
        return 0
    print("\n".join(render(incident)))
    return 0


def cmd_capture(args: argparse.Namespace) -> int:
    where = statedir.ensure_dir(state_dir(args.config), "job.state_dir")
    if len(args.reason) > captures.MAX_TEXT or not args.reason.isprintable():
        raise UsageError(f"--reason must be printable text of at most {captures.MAX_TEXT} characters")
    req = captures.CaptureRequest(secrets.token_hex(8), operator(), args.reason, time.time())
    alive = status.send_request(where, captures.FILE_NAME, captures.encode(req), "capture request")
    if not alive:
        print(f"capture requested (id {req.id}), but no supervisor runs this job now: nothing will be captured")
        return 1
    print(
        f"capture requested (id {req.id}): the running supervisor captures within a second; `ftsup incidents` lists it"
    )
    return 0


# --------------------------------------------------------------------------- rendering


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix))


def _why(i: Incident) -> str:
    text = i.culprit_why if i.culprit is not None else i.reason
    return text if len(text) <= 100 else text[:97] + "..."


def render(i: Incident) -> list[str]:
    """`ftsup incidents show ID` as lines: what happened, the culprit, each group of ranks with one stack, the last
    heartbeats and log lines, the NCCL dumps, what went wrong on the way."""
    step = f", step {i.step}" if i.step is not None else ""
    out = [f"incident {i.id}: {i.trigger} ({i.event}), attempt {i.attempt}{step}, {_when(i.created_unix)} UTC"]
    out.append(f"  reason: {i.reason}")
    if i.culprit is not None:
        policy = f" (the heartbeats alone blamed rank {i.blamed})" if i.blamed not in (None, i.culprit) else ""
        out.append(f"  culprit: rank {i.culprit}: {i.culprit_why}{policy}")
    elif i.culprit_why:
        out.append(f"  culprit: none named: {i.culprit_why}")
    if i.duration_s is not None:
        tools = sorted({r.tool for r in i.ranks if r.tool})
        how = f", stacks by {', '.join(tools)}" if tools else ", no stack tool answered: the kernel's view only"
        whole = "" if i.complete else "; some ranks' evidence is missing (see problems)"
        out.append(f"  captured in {i.duration_s:.2f}s (bound {i.timeout_s:g}s){how}{whole}")
    if i.anomaly is not None:
        out.append("  anomaly: " + ", ".join(f"{k}={v}" for k, v in sorted(i.anomaly.items()) if v not in (None, [])))
    by_rank = {r.rank: r for r in i.ranks}
    groups = stacks.group((r.rank, r.threads) for r in i.ranks)
    groups.sort(key=lambda g: i.culprit not in g[0])  # the culprit's group first
    for ranks, threads in groups:
        out += [""] + _group(ranks, threads, by_rank, i.created_unix)
    lines = [(r.rank, ln) for r in sorted(i.ranks, key=lambda r: r.rank != i.culprit) for ln in r.log_tail[-5:]]
    if lines:
        out += ["", "last lines of each rank's output:"] + [f"  [rank{r}] {ln}" for r, ln in lines]
    if i.nccl:
        out += ["", "NCCL flight recorder dumps (read them with torch's `fr_trace`):"]
        out += [f"  rank {d.rank}: {d.file} ({d.bytes} bytes)" for d in i.nccl]
    problems = [(r.rank, p) for r in i.ranks for p in r.problems]
    if problems:
        out += ["", "problems:"] + [f"  rank {r}: {p}" for r, p in problems]
    return out


def _group(
    ranks: Sequence[int], threads: Sequence[stacks.Thread], by_rank: dict[int, RankEvidence], t: float
) -> list[str]:
    """One group's header (its ranks, their states and last beats) and its threads' stacks, the main thread first."""
    members = [by_rank[r] for r in ranks]
    states = sorted({f"{m.state}" + (f" ({m.wchan})" if m.wchan else "") for m in members if m.state})
    where = {True: "inside a collective", False: "outside any collective", None: "no stack to tell"}
    told = sorted({where[m.collective] for m in members})
    out = [f"{stacks.ranks_text(ranks)}: state {', '.join(states) or '?'}; {', '.join(told)}"]
    for m in members:
        if m.step is not None and m.beat_unix is not None:
            ago = max(0.0, t - m.beat_unix)
            out.append(f"  rank {m.rank} (pid {m.pid}): last beat step {m.step} ({m.phase}), {ago:.1f}s before")
    for th in sorted(threads, key=lambda x: not x.main):
        status = f", {th.status}" if th.status else ""
        out.append(f"  thread {th.name}{' (main)' if th.main else ''}{status}:")
        if th.cut:
            out.append("    ... (outer frames cut)")
        out += [f"    {f}" for f in th.frames] or ["    (no frames)"]
    return out
