"""`ftsup bench anomaly`: how fast the training-health detectors catch a NaN or a loss spike, what a rollback costs
against a crash's recovery, and whether a clean run raises any alarm.

Each run is the reference trainer under `ftsup run` (`faults.refjob`), its figures read from the supervisor's log
(`faults.chaos`); what each scenario and column measures: docs/benchmarks.md, "Anomalies and rollbacks".
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftsup.tools.bench import shared
from ftsup.tools.faults import chaos, refjob

SCENARIOS = ("nan", "spike", "kill", "slow", "clean")
STRAGGLER_WITHIN_STEPS = 20
FIGURES = ("delay_steps", "onset_error", "rollback_s", "detect_to_first_step_s", "recover_s", "load_s", "reported_step")
ALARMS = ("anomaly_detected", "straggler_detected", "throughput_drift_detected", "rollback_started")
RUN_TIMEOUT_S = 600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The description and flags of `ftsup bench anomaly`."""
    p.description = (
        "Run the reference trainer's nan and spike faults under ftsup run: detection delay in steps, rollback -> "
        "first resumed step against a crash's recovery, false positives over clean runs (see "
        "ftsup/tools/bench/anomaly.py). Runs torch only in subprocesses."
    )
    shared.add_output(p)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS))
    p.add_argument("--repeats", type=shared.positive, default=3, help="runs of each fault (median), default 3")
    p.add_argument("--clean-runs", type=shared.positive, default=3, help="runs without a fault, default 3")
    p.add_argument("--clean-steps", type=shared.positive, default=300, help="steps of each clean run, default 300")
    p.add_argument("--fault-step", type=shared.positive, default=40, help="the step the faults hit, default 40")
    p.add_argument("--spike-len", type=shared.positive, default=5, help="steps of poisoned samples, default 5")
    p.add_argument("--slow-factor", type=float, default=3.0, help="how much slower the straggler is, default 3")
    p.add_argument("--steps", type=shared.positive, default=80, help="steps of each faulted run, default 80")
    p.add_argument("--min-step-s", type=float, default=0.05, help="the trainer's minimum step time, default 0.05")


# --------------------------------------------------------------------------- what the logs say (pure)


def incident(events: Sequence[chaos.LogEvent], fault_step: int) -> dict[str, Any]:
    """What followed a nan or spike fault at `fault_step`, from the supervisor's log: the first
    anomaly, the rollback after it and the relaunch's first step. Keys whose event never came are absent."""
    out: dict[str, Any] = {
        "rollbacks": sum(e.event == "rollback_started" for e in events),
        "escalated": any(e.event == "anomaly_escalated" for e in events),
    }
    found = chaos.first_event(events, ["anomaly_detected"], float("-inf"))
    if found is None:
        return out
    f = found.fields
    out.update(kind=f.get("kind"), detected_step=f.get("step"), onset_step=f.get("onset_step"), rank=f.get("rank"))
    if isinstance(f.get("step"), int):
        out["delay_steps"] = f["step"] - fault_step
    if isinstance(f.get("onset_step"), int):
        out["onset_error"] = f["onset_step"] - fault_step
    rolled = chaos.first_event(events, ["rollback_started"], found.t)
    if rolled is None:
        return out
    out.update(to_step=rolled.fields.get("to_step"), skips=rolled.fields.get("skips"))
    first = chaos.first_event(events, ["first_step_reached"], rolled.t)
    if first is not None:
        out.update(
            rollback_s=_ms(first.t - rolled.t),
            detect_to_first_step_s=_ms(first.t - found.t),
            resumed_step=first.fields.get("step"),
            attempt=first.fields.get("attempt"),
        )
    return out


def crash(events: Sequence[chaos.LogEvent]) -> dict[str, Any]:
    """What followed a crash: its failure event -> the relaunch's first step."""
    failure = chaos.first_event(events, chaos.FAILURE_EVENTS, float("-inf"))
    if failure is None:
        return {}
    out: dict[str, Any] = {"detected_by": failure.event}
    first = chaos.first_event(events, ["first_step_reached"], failure.t)
    if first is not None:
        out.update(
            recover_s=_ms(first.t - failure.t),
            resumed_step=first.fields.get("step"),
            attempt=first.fields.get("attempt"),
        )
    return out


def straggler(events: Sequence[chaos.LogEvent]) -> dict[str, Any]:
    """What a slowed rank caused: its first `straggler_detected`, and any failure (it must not be killed)."""
    out: dict[str, Any] = {"failures": [e.event for e in events if e.event in chaos.FAILURE_EVENTS]}
    found = chaos.first_event(events, ["straggler_detected"], float("-inf"))
    if found is not None:
        out.update(
            reported_step=found.fields.get("step"), rank=found.fields.get("rank"), ratio=found.fields.get("ratio")
        )
    return out


def alarms(events: Sequence[chaos.LogEvent]) -> list[dict[str, Any]]:
    """Every alarm a clean run raised (each one a false positive)."""
    return [
        {"event": e.event, **{k: e.fields.get(k) for k in ("kind", "step", "rank", "value", "threshold")}}
        for e in events
        if e.event in ALARMS
    ]


def summarize(name: str, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result row: medians over `runs` (each a dict of `incident`, `crash` or clean figures plus "exit")."""
    row: dict[str, Any] = {"name": name, "runs": len(runs), "exits": [r.get("exit") for r in runs]}
    for key in FIGURES:
        values = [r.get(key) for r in runs]
        if any(v is not None for v in values):
            row[key] = chaos.median(values)
            row[f"{key}_max"] = max(v for v in values if v is not None)
    if name == "clean":
        row["false_positives"] = sum(len(r.get("alarms", [])) for r in runs)
    missing = [i for i, r in enumerate(runs) if name in ("nan", "spike") and r.get("rollback_s") is None]
    if missing:
        row["note"] = f"{len(missing)} of {len(runs)} runs without a rollback and a resumed step"
    unseen = [i for i, r in enumerate(runs) if name == "slow" and r.get("reported_step") is None]
    if unseen:
        row["note"] = f"{len(unseen)} of {len(runs)} runs without a straggler reported"
    row["samples"] = list(runs)
    return row


def checks(rows: Sequence[dict[str, Any]], patience: int | None) -> dict[str, dict[str, Any]]:
    """The targets over the rows: each {"pass": bool | None (not measured), the figures}."""
    by = {r["name"]: r for r in rows}
    out: dict[str, dict[str, Any]] = {}

    def worst(name: str, key: str) -> Any:
        samples = by[name]["samples"]
        got = [s.get(key) for s in samples]
        return None if not samples or any(v is None for v in got) else max(got)

    if "nan" in by:
        late = worst("nan", "delay_steps")
        out["nan_detected_on_its_step"] = {"pass": late == 0, "max_delay_steps": late}
    if "spike" in by:
        late = worst("spike", "delay_steps")
        ok = None if patience is None else late is not None and 0 <= late <= patience
        out["spike_detected_within_patience"] = {"pass": ok, "max_delay_steps": late, "patience": patience}
    if "kill" in by and any(n in by for n in ("nan", "spike")):
        rollback = chaos.median([by[n].get("rollback_s") for n in ("nan", "spike") if n in by])
        recover = by["kill"].get("recover_s")
        load = chaos.median([by[n].get("load_s") for n in ("nan", "spike") if n in by])
        budget = None if recover is None else recover + (load or 0.0)
        ok = None if rollback is None or budget is None else rollback <= budget
        out["rollback_within_crash_recovery_plus_load"] = {
            "pass": ok,
            "rollback_s": rollback,
            "recover_s": recover,
            "load_s": load,
        }
    if "slow" in by:
        late = worst("slow", "reported_step")
        killed = sum(len(s.get("failures", [])) for s in by["slow"]["samples"])
        ok = late is not None and late <= STRAGGLER_WITHIN_STEPS and killed == 0
        out["straggler_reported_and_not_killed"] = {
            "pass": ok,
            "max_reported_step": late,
            "failures": killed,
            "within_steps": STRAGGLER_WITHIN_STEPS,
        }
    if "clean" in by:
        fp = by["clean"]["false_positives"]
        out["no_false_positives"] = {"pass": fp == 0, "false_positives": fp, "runs": by["clean"]["runs"]}
    exits = {r["name"]: r["exits"] for r in rows}
    out["every_job_finished"] = {"pass": all(c == 0 for e in exits.values() for c in e), "exits": exits}
    return out


# --------------------------------------------------------------------------- running the jobs


def _fault_args(name: str, args: argparse.Namespace) -> list[str]:
    at = args.fault_step
    fault = {
        "nan": f"nan@{at}:1",
        "spike": f"spike@{at}:{args.spike_len}",
        "kill": f"kill@{at}",
        "slow": f"slow@1:{args.slow_factor:g}",
    }[name]
    # nan and spike are keyed to data positions, in every attempt; kill only in the first, so the relaunch runs on.
    return ["--fault", fault, "--fault-rank", "1", "--fault-attempt", "1" if name == "kill" else "-1"]


def _one_run(root: Path, name: str, i: int, args: argparse.Namespace) -> dict[str, Any]:
    clean = name == "clean"
    job = refjob.TrainerJob(
        root / f"{name}-{i}",
        refjob.new_run_id(f"anomaly-{name}"),
        steps=args.clean_steps if clean else args.steps,
        min_step_s=0.0 if name == "slow" else args.min_step_s,
        extra_args=() if clean else tuple(_fault_args(name, args)),
    )
    job.write_config()
    proc = refjob.start_supervisor(job, "run")
    try:
        code = refjob.wait_exit(proc, RUN_TIMEOUT_S, f"the {name} job")
    finally:
        refjob.stop_supervisor(proc, job)
    events = chaos.read_events(job.supervisor_log)
    got: dict[str, Any] = {"exit": code, "dir": str(job.root)}
    if clean:
        got["alarms"] = alarms(events)
        return got
    if name == "slow":
        got.update(straggler(events))
        return got
    got.update(crash(events) if name == "kill" else incident(events, args.fault_step))
    if isinstance(got.get("attempt"), int):
        got["load_s"] = chaos.attempt_load_s(job.log_dir, got["attempt"])
    return got


def _patience(root: Path) -> int | None:
    """`anomaly.loss_patience_steps` as `ftsup run` reads the job's config (None: no such key)."""
    from ftsup.supervisor.config.job import load_config

    job = refjob.TrainerJob(root / "config-probe", "probe", steps=1)
    anomaly = load_config(job.write_config()).to_dict().get("anomaly") or {}
    value = anomaly.get("loss_patience_steps")
    return value if isinstance(value, int) else None


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every target held; 1 otherwise (the table says which)."""
    from ftsup.supervisor.errors import UsageError

    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not wanted or set(wanted) - set(SCENARIOS):
        raise UsageError(f"--scenarios takes {', '.join(SCENARIOS)}, got {args.scenarios!r}")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ftsup-bench-anomaly-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"ftsup bench anomaly in {root} (load average {_load()})", flush=True)
    env: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "loadavg_start": _load(),
        "dir": str(root),
        "min_step_s": args.min_step_s,
        "fault_step": args.fault_step,
    }
    rows = []
    for name in wanted:
        n = args.clean_runs if name == "clean" else args.repeats
        t0 = time.monotonic()
        rows.append(summarize(name, [_one_run(root, name, i, args) for i in range(n)]))
        print(f"  {name}: {n} run(s) in {time.monotonic() - t0:.0f} s", flush=True)
    env["loadavg_end"] = _load()
    verdicts = checks(rows, _patience(root))
    out = {"results": rows, "checks": verdicts, "environment": env}
    print(table(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(c["pass"] for c in verdicts.values()) else 1


def table(out: dict[str, Any]) -> str:
    head = (
        "name",
        "runs",
        "delay_steps",
        "onset_error",
        "rollback_s",
        "recover_s",
        "load_s",
        "reported_step",
        "false_positives",
        "note",
    )
    rows = [head] + [tuple(_fmt(r.get(k)) for k in head) for r in out["results"]]
    widths = [max(len(r[c]) for r in rows) for c in range(len(head) - 1)]
    lines = ["", *("  ".join(r[c].ljust(w) for c, w in enumerate(widths)) + "  " + r[-1] for r in rows), "", "checks:"]
    for name, c in out["checks"].items():
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[c["pass"]]
        lines.append(f"  {name}: {verdict} {json.dumps({k: v for k, v in c.items() if k != 'pass'})}")
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def _ms(seconds: float) -> float:
    return round(seconds, 3)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
