"""`ftsup status --config JOB.yaml [--json]`: what the supervisor of a job is doing, or did last.

It reads the journal, the ranks as last heard and the store, and changes nothing; every file is hostile input
(docs/cli.md, `ftsup status`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from ftsup.protocol import MAX_STEP
from ftsup.store import layout
from ftsup.store.errors import os_words
from ftsup.supervisor import statedir
from ftsup.supervisor.cli import memstatus
from ftsup.supervisor.cli import nodes as cli_nodes
from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.errors import UsageError
from ftsup.supervisor.policy import goodput, saves
from ftsup.supervisor.state import ranks as rankstatus
from ftsup.supervisor.state.journal import Journal, JournalError, JournalRecord

ENDED = ("succeeded", "failed", "stopped", "evicted")


def supervisor_alive(rec: JournalRecord | None) -> bool:
    """Whether the supervisor that wrote `rec` still runs: not ended, and its pid a process of this user that
    existed when the record was written."""
    if rec is None or rec.status in ENDED:
        return False
    try:
        proc = psutil.Process(rec.supervisor_pid)
        return (
            proc.uids().real == os.getuid()
            and proc.status() != psutil.STATUS_ZOMBIE
            and proc.create_time() <= rec.updated_unix + 1.0
        )
    except (psutil.Error, OSError):
        return False


def send_request(state_dir: Path, name: str, data: bytes, what: str) -> bool:
    """Write the operator's request `data` as the file `name` of `state_dir` (UsageError naming `what` when it
    cannot be), and say whether a supervisor runs the job now to serve it."""
    path = state_dir / name
    try:
        statedir.write_atomic(path, data)
    except OSError as e:
        raise UsageError(f"{path}: {os_words(e)}; the {what} was not written") from None
    try:
        return supervisor_alive(Journal(state_dir / "journal.json").read())
    except JournalError:
        return False


def gather(state_dir: Path, checkpoint_dir: Path, now: float, durable_url: str | None = None) -> dict[str, Any]:
    """The status as one JSON-ready object. A ranks file that cannot be used is said so (`ranks_problem`) and
    skipped; a journal that cannot is an error (`JournalError`: exit 2, one line)."""
    rec = Journal(state_dir / "journal.json").read()
    alive = supervisor_alive(rec)
    latest = layout.latest_consistent(checkpoint_dir)
    ranks: list[dict[str, Any]] = []
    problem = None
    try:
        table = rankstatus.read(state_dir / rankstatus.FILE_NAME)
    except rankstatus.RankStatusError as e:
        table, problem = None, f"ignored: {e}"
    if table is not None:
        attempt, _, heard = table
        for r in heard:
            ranks.append(
                {
                    "attempt": attempt,
                    "rank": r.rank,
                    "local_rank": r.local_rank,
                    "pid": r.pid,
                    "step": r.step,
                    "phase": r.phase,
                    "loss": r.loss,
                    "heartbeat_unix": r.beat_unix,
                    "heartbeat_age_s": round(max(0.0, now - r.beat_unix), 3),
                }
            )
    metrics = rec.extra.get("metrics") if rec is not None and alive else None
    return {
        "supervisor_running": alive,
        "supervisor_pid": rec.supervisor_pid if rec is not None else None,
        "journal": rec.to_json() if rec else None,
        "latest_checkpoint": latest.to_json() if latest else None,
        "checkpoint_dir": str(checkpoint_dir),
        "metrics_url": f"http://{metrics}/metrics" if isinstance(metrics, str) else None,
        "ranks": ranks,
        "ranks_problem": problem,
        "last_incident": rec.incident if rec is not None else None,
        "stragglers": list(rec.stragglers) if rec is not None and alive else [],
        "data_skips": [list(r) for r in rec.skips] if rec is not None else [],
        "goodput": _goodput(rec),
        "durable": _durable(rec, durable_url),
        "last_eviction": last_eviction(rec),
    }


_LAST_UNIX = 253402300800  # 10000-01-01: a time past it (or not finite) is no time a status can show


def _durable(rec: JournalRecord | None, url: str | None) -> dict[str, Any] | None:
    """The durable tier as last journaled (the journal is hostile input: each field checked, or left out as
    unknown); None without a tier in the config."""
    if url is None:
        return None
    got = rec.extra.get("durable") if rec is not None else None
    got = got if isinstance(got, dict) and got.get("url") == url else {}

    def step(value: object) -> int | None:
        return value if type(value) is int and 0 <= value < 10**18 else None

    pending = got.get("pending")
    error = got.get("last_error")
    when = got.get("newest_unix")
    return {
        "url": url,
        "newest_step": step(got.get("newest_step")),
        "newest_unix": float(when)
        if isinstance(when, int | float) and not isinstance(when, bool) and 0 <= when < _LAST_UNIX
        else None,
        "pending": [s for s in pending[:1000] if step(s) is not None] if isinstance(pending, list) else [],
        "uploading": step(got.get("uploading")),
        "last_error": error[:500] if isinstance(error, str) else None,
    }


def last_eviction(rec: JournalRecord | None) -> dict[str, Any] | None:
    """The tiers the last eviction's emergency checkpoint reached, as journaled (`emergency_tiers_reached`; the
    journal is hostile input: each field checked, or left out); None when no eviction asked for a save."""
    got = rec.extra.get("emergency_tiers") if rec is not None else None
    if not isinstance(got, dict):
        return None
    step, tiers, left = got.get("step"), got.get("tiers"), got.get("left_s")
    tiers = [t for t in saves.TIERS if isinstance(tiers, list) and t in tiers]
    left = left if isinstance(left, dict) else {}
    return {
        "step": step if type(step) is int and 0 <= step <= MAX_STEP else None,
        "tiers": tiers,
        "left_s": {t: float(v) for t, v in left.items() if t in tiers and type(v) in (int, float) and abs(v) < 1e9},
    }


def _goodput(rec: JournalRecord | None) -> dict[str, Any] | None:
    """The job's time accounting as last journaled: productive and badput seconds, wall time, ratio."""
    if rec is None or rec.goodput is None:
        return None
    saved = goodput.Saved.from_json(rec.goodput)  # checked when the journal was read
    return {**saved.totals.summary(), "as_of_unix": saved.as_of_unix, "since_unix": saved.started_unix}


def cmd_status(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    tier = cfg.checkpoint.durable.url if cfg.checkpoint.durable is not None else None
    now = time.time()
    out = {
        "run_id": cfg.job.run_id,
        "node_id": cfg.launch.node_id,
        **gather(Path(cfg.job.state_dir), Path(cfg.checkpoint.dir), now, tier),
        "node": cli_nodes.gather(Path(cfg.job.state_dir), cfg.launch.node_id, now),
        "memory": memstatus.gather(cfg),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(text(out)))
    return 0


def text(out: dict[str, Any]) -> list[str]:
    rec, alive = out["journal"], out["supervisor_running"]
    head = f"run {out['run_id']} on node {out['node_id']}: supervisor "
    if alive:
        lines = [head + f"running (pid {out['supervisor_pid']})"]
    elif rec is None:
        lines = [head + "not running (no journal: it never ran with this state directory)"]
    elif rec["status"] in ENDED:
        lines = [head + f"not running (it ended: {rec['status']}, at {_utc(rec['updated_unix'])})"]
    else:
        gone = f"pid {out['supervisor_pid']}, which last wrote the journal at {_utc(rec['updated_unix'])}, is gone"
        lines = [head + f"not running ({gone})"]
    if rec is not None:
        start = "from scratch" if rec["resume_step"] is None else f"resumed from step {rec['resume_step']}"
        lines.append(
            f"  {'status' if alive else 'last status'} {rec['status']}, attempt {rec['attempt']}, "
            f"world size {rec['world_size'] if rec['world_size'] is not None else '-'}, {start}"
        )
        if rec["last_failure"]:
            lines.append(f"  last failure: {rec['last_failure']}")
    lines += _incident_lines(out)
    if (node := out.get("node")) is not None and (
        node["checked_unix"] is not None or node["targets"] or node["problems"]
    ):
        lines += cli_nodes.lines(node, indent="  ")
    if (gp := out["goodput"]) is not None and gp["wall_s"] > 0:
        lost = sorted(((s, c) for c, s in gp["badput_s"].items() if s > 0), reverse=True)
        badput = ", ".join(f"{c} {_age(s)}" for s, c in lost) or "none"
        lines.append(
            f"  goodput {gp['ratio']:.3f} over {_age(gp['wall_s'])} (as of {_utc(gp['as_of_unix'])}): "
            f"productive {_age(gp['productive_s'])}; badput {badput}"
        )
    if out["ranks"]:
        lines.append("  ranks" + (" (as last heard; no supervisor hears them now)" if not alive else "") + ":")
        for r in out["ranks"]:
            loss = f", loss {r['loss']:.4g}" if r["loss"] is not None else ""
            lines.append(
                f"    rank {r['rank']} (local {r['local_rank']}, pid {r['pid']}): step {r['step']}, "
                f"{r['phase']}{loss}, last heartbeat {_age(r['heartbeat_age_s'])} ago"
            )
    elif out["ranks_problem"]:
        lines.append(f"  ranks: {out['ranks_problem']}")
    latest = out["latest_checkpoint"]
    where = out["checkpoint_dir"]
    if latest:
        lines.append(
            f"  latest consistent checkpoint: step {latest['step']} ({latest.get('kind') or '?'}, "
            f"{_utc(latest.get('created_unix'))}) in {where}"
        )
    else:
        lines.append(f"  latest consistent checkpoint: none in {where}")
    if (tier := out.get("durable")) is not None:
        lines.append("  " + _durable_line(tier))
    if (memory := out.get("memory")) is not None:
        lines.append("  " + memstatus.line(memory))
    if (ev := out.get("last_eviction")) is not None:
        left = ev["left_s"]
        got = ", ".join(t + (f" ({left[t]:.1f}s before the deadline)" if t in left else "") for t in ev["tiers"])
        lines.append(f"  last eviction: the emergency checkpoint of step {ev['step']} reached {got or 'no tier'}")
    if out["metrics_url"]:
        lines.append(f"  metrics: {out['metrics_url']}")
    return lines


def _durable_line(tier: dict[str, Any]) -> str:
    newest = tier["newest_step"]
    head = f"durable tier {tier['url']}: newest durable checkpoint " + (
        f"step {newest} ({_utc(tier['newest_unix'])})" if newest is not None else "none known"
    )
    waiting = ([f"uploading step {tier['uploading']}"] if tier["uploading"] is not None else []) + (
        [f"waiting: step {', '.join(map(str, tier['pending']))}"] if tier["pending"] else []
    )
    line = head + ("; " + ", ".join(waiting) if waiting else "")
    return line + (f"; last error: {tier['last_error']}" if tier["last_error"] else "")


def _incident_lines(out: dict[str, Any]) -> list[str]:
    lines = []
    if (inc := out["last_incident"]) is not None:
        what = str(inc.get("kind")).replace("_", " ")
        if inc.get("step") is not None:
            what += f" at step {inc['step']} (onset step {inc.get('onset_step')})"
        resumed = inc.get("resumed_from")
        if inc.get("rollback_to") is None:
            done = "escalated: the job stopped"
        elif resumed is None:  # not launched yet
            done = f"rolling back to step {inc['rollback_to']} or before"
        else:
            done = f"rolled back to step {resumed}" if resumed else "rolled back to the start"
        skips = ", ".join(f"[{a}, {b})" for a, b in inc.get("skips") or [])
        lines.append(f"  last incident: {what}, {done}" + (f", skipping data positions {skips}" if skips else ""))
    if out["stragglers"]:
        lines.append(f"  stragglers: rank {', '.join(map(str, out['stragglers']))} (slow, not stopped)")
    if out["data_skips"]:
        lines.append(f"  data skips in force: {', '.join(f'[{a}, {b})' for a, b in out['data_skips'])}")
    return lines


def _utc(t: object) -> str:
    if not isinstance(t, (int, float)):
        return "?"
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _age(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
