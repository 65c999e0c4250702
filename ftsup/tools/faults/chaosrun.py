"""`ftsup chaos`: a seeded plan of faults of every kind thrown at the reference trainer under `ftsup run` (or at a job
of one's own, `configjob`), at random moments, and the invariants checked fault by fault and job by job. The plan
(`plan`) and the checks (`invariants`) are pure; the jobs it runs: docs/chaos.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ftsup.supervisor.errors import UsageError
from ftsup.tools.faults import chaos, invariants, nodes, plan
from ftsup.tools.faults.configjob import NEEDS_REFERENCE_TRAINER, ConfigJob
from ftsup.tools.faults.diskfull import Disk
from ftsup.tools.faults.inject import Target, throw
from ftsup.tools.faults.metadata_server import MetadataServer
from ftsup.tools.faults.refjob import TrainerJob, new_run_id, start_supervisor, stop_supervisor
from ftsup.tools.faults.refjob import wait_exit as _wait_exit

TMPFS_MB = 256
RESTART_S = 10.0  # deploy/systemd/ftsup@.service: RestartSec=10
TIMEOUT_S = 180.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The description and flags of `ftsup chaos`."""
    p.description = (
        "Throw a seeded plan of faults of every kind (ranks killed, hung, slowed or exiting; torchrun and the "
        "supervisor killed; evictions by signal and by metadata server; a node lost; a full disk during a save; a "
        "flipped byte in the newest checkpoint; a kill during a commit) at the reference trainer under ftsup run, "
        "and check the invariants per fault: detected, recovered, no committed checkpoint lost, none loaded corrupt "
        "or torn, no process left; the loss log equal to an uninterrupted run's and no sample skipped or repeated. "
        "Exit 0 only when every invariant held."
    )
    p.add_argument("--faults", type=int, default=100, help="faults in the plan (default 100)")
    p.add_argument("--seed", type=int, default=0, help="the plan's seed (default 0)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as one JSON object to FILE")
    p.add_argument("--dir", type=Path, metavar="DIR", help="work directory (default: a fresh temporary directory)")
    p.add_argument("--kinds", default=",".join(plan.KINDS), help="comma-separated fault kinds (default: all)")
    p.add_argument(
        "--restart-s",
        type=float,
        default=RESTART_S,
        help="a killed or evicted supervisor, and a lost node, start again this long after they went, "
        f"as systemd's RestartSec (default {RESTART_S:g})",
    )
    p.add_argument("--min-step-s", type=float, default=0.1, help="the reference trainer's step time (default 0.1)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=TIMEOUT_S,
        help=f"the longest wait for one thing of a job (default {TIMEOUT_S:g})",
    )
    g = p.add_argument_group("a job of one's own instead of the reference trainer (ftsup.tools.faults.configjob)")
    g.add_argument("--config", type=Path, metavar="JOB.yaml", help="the job's config, as `ftsup run --config` takes it")
    g.add_argument(
        "--loss-log",
        type=Path,
        metavar="FILE",
        help="with --config (required): the file the job appends "
        "one JSON line per step to (step, loss, world_size; loss_hex for a bitwise comparison)",
    )
    g.add_argument(
        "--sample-log",
        metavar="PATTERN",
        help="with --config: each rank's sample-id log, {rank} for the "
        "rank (step, rank, world_size, ids); without it samples are not checked",
    )
    g.add_argument(
        "--ckpt-every",
        type=int,
        default=plan.CKPT_EVERY,
        help=f"with --config: its checkpoint interval in steps (default {plan.CKPT_EVERY})",
    )


def run(args: argparse.Namespace) -> int:
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if args.faults < 1:
        raise UsageError(f"--faults must be at least 1, got {args.faults}")
    if args.restart_s < 0 or args.min_step_s <= 0 or args.timeout_s <= 0:
        raise UsageError("--restart-s must be >= 0, --min-step-s and --timeout-s > 0")
    try:
        faults = plan.make_plan(args.faults, args.seed, kinds)
    except ValueError as e:
        raise UsageError(f"--kinds: {e}") from None
    root = Path(args.dir).absolute() if args.dir else Path(tempfile.mkdtemp(prefix="ftsup-chaos-"))
    if root.exists() and any(root.iterdir()):
        raise UsageError(f"{root} is not empty; give --dir a new or empty directory")
    own = _own_job(args) if args.config else None
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        not_run: dict[str, str] = {}
        if own is not None:
            not_run.update((k, why) for k, why in NEEDS_REFERENCE_TRAINER.items() if k in {f.kind for f in faults})
        disk = None
        if any(f.kind == "disk-full" for f in faults):
            disk = _mount(stack, root / "main-disk", not_run)
        return _run(args, root, faults, kinds, disk, not_run, own)


def _own_job(args: argparse.Namespace) -> dict[str, Any]:
    """`--config`: the job's config, validated as `ftsup run` would, with every default filled in."""
    from ftsup.supervisor.config.job import load_config

    if args.loss_log is None:
        raise UsageError("--config needs --loss-log FILE: the file the job appends its loss log to")
    if args.loss_log.exists():
        raise UsageError(f"--loss-log {args.loss_log} exists; ftsup chaos needs it to start empty (move it away)")
    if args.ckpt_every < 1:
        raise UsageError(f"--ckpt-every must be at least 1, got {args.ckpt_every}")
    return load_config(args.config).to_dict()


def _mount(stack: contextlib.ExitStack, where: Path, not_run: dict[str, str]) -> Disk | None:
    """The main job's store on a tmpfs of its own, or None with the reason in `not_run`."""
    why = Disk.unavailable()
    if why is None:
        try:
            return stack.enter_context(Disk(where, TMPFS_MB))
        except OSError as e:
            why = str(e)
    not_run["disk-full"] = why
    return None


def _run(
    args: argparse.Namespace,
    root: Path,
    faults: list[plan.Planned],
    kinds: tuple[str, ...],
    disk: Disk | None,
    not_run: dict[str, str],
    own: dict[str, Any] | None,
) -> int:
    thrown = [f for f in faults if f.kind not in not_run]
    main = [f for f in thrown if f.kind not in plan.NODE_KINDS]
    on_nodes = [f for f in thrown if f.kind in plan.NODE_KINDS]
    steps = max(plan.steps_needed(main, plan.CKPT_EVERY), plan.steps_needed(on_nodes, plan.CKPT_EVERY))
    what = f"{args.config} (its own steps)" if own is not None else f"the reference trainer, {steps} steps per job"
    print(f"ftsup chaos in {root}: {len(faults)} faults (seed {args.seed}) at {what}", flush=True)
    result: dict[str, Any] = {
        "dir": str(root),
        "seed": args.seed,
        "faults_planned": len(faults),
        "steps": steps,
        "job": str(args.config) if own is not None else "reference trainer",
        "plan": [f.to_json() for f in faults],
        "not_run": not_run,
        "jobs": {},
    }
    t0 = time.monotonic()
    ref = _job(root / "reference", "chaos-ref", steps, args, own)
    result["jobs"]["reference"] = _run_reference(ref, args.timeout_s)
    if isinstance(ref, ConfigJob):
        ref.collect()
        steps = result["steps"] = invariants.last_step(ref.root / "loss.jsonl")
    records: list[dict[str, Any]] = []
    if main and result["jobs"]["reference"]["exit_code"] == 0:
        job_result, got = _run_main(root, steps, main, args, disk, own)
        result["jobs"]["main"] = job_result
        records += got
    if on_nodes and result["jobs"]["reference"]["exit_code"] == 0:
        job_result, got = _run_nodes(root, steps, on_nodes, args)
        result["jobs"]["nodes"] = job_result
        records += got
    for rec in records:
        rec["violations"] = invariants.fault_violations(rec)
    records.sort(key=lambda r: r["index"])
    result["faults"] = records
    result["kinds"] = invariants.by_kind(records, [k for k in plan.KINDS if k in kinds])
    result["violations"] = [f"fault {r['index']} ({r['kind']}): {v}" for r in records for v in r["violations"]]
    result["violations"] += [f"{name}: {v}" for name, job in result["jobs"].items() for v in job.get("violations", ())]
    if len(records) < len(thrown):
        result["violations"].append(f"{len(thrown) - len(records)} planned fault(s) never thrown: cut short")
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["ok"] = not result["violations"]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(report(result), flush=True)
    return 0 if result["ok"] else 1


def _job(
    root: Path, prefix: str, steps: int, args: argparse.Namespace, own: dict[str, Any] | None = None, **kw: Any
) -> TrainerJob:
    """The job in `root`: the reference trainer with the same flags for every job (paths aside), or `own`."""
    extra = ("--sample-log", str(root / "samples-{rank}.jsonl"), *kw.pop("extra_args", ()))
    if own is not None:
        nproc = own["launch"]["nproc_per_node"]
        return ConfigJob(
            root,
            new_run_id(prefix),
            0,
            ckpt_every=args.ckpt_every,
            min_step_s=args.min_step_s,
            nproc=nproc if isinstance(nproc, int) else 1,
            base_config=own,
            user_loss_log=args.loss_log.absolute(),
            **kw,
            sample_pattern=os.path.abspath(args.sample_log) if args.sample_log else None,
        )
    return TrainerJob(
        root, new_run_id(prefix), steps, ckpt_every=plan.CKPT_EVERY, min_step_s=args.min_step_s, extra_args=extra, **kw
    )


def _run_s(job: TrainerJob, timeout_s: float) -> float:
    """How long a whole run of `job` may take: its steps at a tenth of their pace (two busy cores); a job of
    one's own, a day."""
    return 86400.0 if isinstance(job, ConfigJob) else timeout_s + job.steps * job.min_step_s * 10


def _run_reference(ref: TrainerJob, timeout_s: float) -> dict[str, Any]:
    ref.write_config()
    print(f"[reference] {ref.nproc} rank(s), uninterrupted ...", flush=True)
    t0 = time.monotonic()
    proc = start_supervisor(ref, "1")
    try:
        code = _wait_exit(proc, _run_s(ref, timeout_s), "the uninterrupted run")
    except chaos.ChaosError as e:
        return {"exit_code": None, "violations": [str(e)]}
    finally:
        stop_supervisor(proc, ref)
    wall = round(time.monotonic() - t0, 1)
    print(f"            exit {code} after {wall} s", flush=True)
    return {"exit_code": code, "wall_s": wall, "violations": [] if code == 0 else [f"exited {code}"]}


def _run_main(
    root: Path,
    steps: int,
    faults: list[plan.Planned],
    args: argparse.Namespace,
    disk: Disk | None,
    own: dict[str, Any] | None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    print(f"[main] {len(faults)} faults on one node ...", flush=True)
    with MetadataServer() as server:
        sections = {
            "restart": {"max_restarts": len(faults) + 10},
            "eviction": {
                "signals": list(plan.SIGNALS),
                "providers": list(plan.PROVIDERS),
                "endpoint": server.url,
                "poll_interval_s": 0.2,
                "default_deadline_s": 30,
                "save_margin_s": 2,
            },
        }
        asks = ("--fault-file", str(root / "main" / "fault.json"))
        job = _job(
            root / "main",
            "chaos-main",
            steps,
            args,
            own,
            sections=sections,
            store=disk.store if disk else None,
            extra_args=asks,
        )
        job.write_config()
        records: list[dict[str, Any]] = []
        out: dict[str, Any] = {"exit_code": None, "error": None}
        proc = start_supervisor(job, "1")
        t: Target | None = None
        try:
            with chaos.LossLogTail(job.loss_log) as tail:
                t = Target(job, proc, tail, server, disk, args.restart_s, args.timeout_s)
                for f in faults:
                    try:
                        rec = throw(t, f)
                    except chaos.ChaosError as e:
                        records.append({"index": f.index, "kind": f.kind, "variant": f.variant, "error": str(e)})
                        raise
                    records.append(rec)
                    print(f"  {_fault_line(rec)}", flush=True)
                out["exit_code"] = _wait_exit(t.proc, _run_s(job, args.timeout_s), "the main job")
                t.codes.append(out["exit_code"])
                out["left"] = [chaos.describe(p) for p in chaos.matching_processes(job.markers)]  # before any cleanup
        except chaos.ChaosError as e:
            out["error"] = str(e)
        finally:
            stop_supervisor(t.proc if t else proc, job)
            out["supervisor_exit_codes"] = t.codes if t else []
        if isinstance(job, ConfigJob):
            job.collect()
        out.update(_job_checks(root / "reference", job.root, steps, out, job.markers))
    return out, records


def _run_nodes(
    root: Path, steps: int, faults: list[plan.Planned], args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    print(f"[nodes] {len(faults)} node losses, two nodes of one rank ...", flush=True)
    base = _job(root / "nodes", "chaos-nodes", steps, args, nproc=1)
    job = nodes.NodeJob(base, nodes.free_port())
    got = nodes.run(job, faults, args.restart_s, args.timeout_s)
    for rec in got["faults"]:
        print(f"  {_fault_line(rec)}", flush=True)
    out: dict[str, Any] = {
        "exit_code": max(got["exit_codes"].values(), default=None) if got["exit_codes"] else None,
        "exit_codes": got["exit_codes"],
        "error": got["error"],
        "left": got["left"],
    }
    if len(got["exit_codes"]) < len(nodes.NODES) or any(c != 0 for c in got["exit_codes"].values()):
        out["exit_code"] = next((c for c in got["exit_codes"].values() if c != 0), None)
    out.update(_job_checks(root / "reference", base.root, steps, out, [m for n in nodes.NODES for m in job.markers(n)]))
    return out, got["faults"]


def _job_checks(ref_root: Path, root: Path, steps: int, out: dict[str, Any], markers: list[str]) -> dict[str, Any]:
    """The job's invariants: completed, its loss log and samples (`root`'s) the reference's, nothing left running."""
    violations = []
    if out.get("error"):
        violations.append(f"cut short: {out['error']}")
    if out.get("exit_code") != 0:
        violations.append(f"the job did not complete: exit {out.get('exit_code')}")
    losses = invariants.loss_log_check(ref_root / "loss.jsonl", root / "loss.jsonl", steps)
    ref_logs = sorted(ref_root.glob("samples-*.jsonl"))
    samples: dict[str, Any] = {"steps_checked": 0, "samples": None, "violations": [], "note": "no sample logs"}
    if ref_logs:
        ref_ids = invariants.sample_ids(ref_root / "loss.jsonl", ref_logs)
        ids = invariants.sample_ids(root / "loss.jsonl", sorted(root.glob("samples-*.jsonl")))
        samples = invariants.samples_check(ref_ids, ids, steps)
    # What the job left once its supervisors exited (taken before the cleanup, which kills it), and whatever a run
    # cut short left past its cleanup.
    left = list(out.get("left", [])) + [chaos.describe(p) for p in chaos.matching_processes(markers)]
    if left:
        violations.append(f"{len(left)} process(es) left running: {left[:5]}")
    violations += losses["violations"] + samples["violations"]
    return {"loss_log": losses, "samples": samples, "leftover_processes": left, "violations": violations}


# --------------------------------------------------------------------------- the report


def _s(v: Any) -> str:
    return "-" if v is None else f"{v:g} s"


def _n(v: Any) -> str:
    return "-" if v is None else f"{v:g}"


def _fault_line(r: dict[str, Any]) -> str:
    head = f"[{r['index']:>3}] {r['kind']}{' ' + r['variant'] if r.get('variant') else ''} at step {r.get('at_step')}"
    if r.get("error"):
        return f"{head}: ERROR {r['error']}"
    if r["kind"] == "straggler":
        return (
            f"{head}: steps {r.get('step_s_before')} s -> {r.get('step_s_during')} s for {r.get('window_s')} s, "
            f"{'RESTARTED' if r.get('restarted') else 'no restart'}"
        )
    if r["kind"] == "disk-full":
        return (
            f"{head}: {r.get('saves_failed')} failed save(s) logged, "
            f"{'RESTARTED' if r.get('restarted') else 'no restart'}, step {r.get('committed_after')} "
            f"committed {_s(r.get('recover_s'))} after the store filled"
        )
    detected = f"detected by {r['detected_by']} after {_s(r.get('detect_s'))}" if r.get("detected_by") else ""
    return (
        f"{head}: {detected or 'no detection'}, resumed from step {r.get('loaded_step', '-')}, first step "
        f"{_s(r.get('recover_s'))} after the fault, {_n(r.get('lost_steps'))} step(s) redone"
    )


def report(r: dict[str, Any]) -> str:
    lines = [
        "",
        f"ftsup chaos: seed {r['seed']}, {r['faults_planned']} faults planned, {r['steps']} steps per job, "
        f"{r.get('wall_s')} s, in {r['dir']}",
    ]
    lines.append(
        f"{'kind':<16} {'faults':>6} {'violations':>10} {'detect (median)':>16} {'recover (median)':>17} "
        f"{'redone (median/max)':>20}"
    )
    for row in r.get("kinds", []):
        if row["kind"] in r["not_run"]:
            lines.append(f"{row['kind']:<16} {'not run':>6}: {r['not_run'][row['kind']]}")
            continue
        redone = f"{_n(row['steps_redone_median'])} / {_n(row['steps_redone_max'])}"
        lines.append(
            f"{row['kind']:<16} {row['count']:>6} {row['violations']:>10} {_s(row['detect_s_median']):>16} "
            f"{_s(row['recover_s_median']):>17} {redone:>20}"
        )
    total = sum(row["count"] for row in r.get("kinds", []))
    lines.append(f"{'all':<16} {total:>6} {len(r['violations']):>10}")
    for name, job in r["jobs"].items():
        losses = job.get("loss_log")
        detail = ""
        if losses:
            detail = f", loss log: {losses['bitwise_steps']} step(s) bitwise, max rel diff {losses['max_rel_diff']:.2g}"
        lines.append(f"job {name}: exit {job.get('exit_code')}{detail}")
    lines += [f"VIOLATION {v}" for v in r["violations"]]
    lines.append("PASS: every invariant held" if r["ok"] else "FAIL")
    return "\n".join(lines)
