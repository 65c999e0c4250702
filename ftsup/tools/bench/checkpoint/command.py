"""`ftsup bench checkpoint`: one run comparing ftsup's checkpoint engine with its peers.

This process (torch-free) writes a spec per group of ranks, launches the groups one after another, combines the
ranks' records (`report`), prints a table and writes the JSON; the groups and what each row measures:
docs/benchmarks.md, "The checkpoint engine against its peers".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ftsup.store import hublayout
from ftsup.tools.bench.checkpoint import durable_rows, hf_report, launch, report
from ftsup.tools.bench.checkpoint.shape import shape_for

MAIN_ROWS = (
    "raw_write",
    "memcpy",
    "torch_save",
    "dcp_save",
    "dcp_async",
    "ftsup_async",
    "ftsup_rss",
    "ftsup_sync",
    "ftsup_load_same",
)
RESHARD_ROWS = ("dcp_load_reshard", "ftsup_load_reshard")
PROCESS_ROWS = ("dcp_async_process",)
# Load rows need a checkpoint some save row wrote: load row -> save row.
_SOURCES = {"ftsup_load_same": "ftsup_sync", "ftsup_load_reshard": "ftsup_sync", "dcp_load_reshard": "dcp_save"}
# Statuses that mean "the benchmark itself went wrong" (exit code 1).
_BAD = {"error", "failed", "timeout", "missing", "incomplete"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `ftsup bench checkpoint` (also `python -m ftsup.tools.bench checkpoint`)."""
    parser.description = "Benchmark the checkpoint engine against torch.save and DCP (docs/benchmarks.md)."
    parser.add_argument(
        "--size-mb",
        type=float,
        default=1024.0,
        help="synthetic model+AdamW state in MiB over all ranks (default 1024)",
    )
    parser.add_argument("--ranks", type=int, default=2, help="world size that saves (default 2)")
    parser.add_argument(
        "--dir",
        required=True,
        type=Path,
        help="folder to write into; a fresh subfolder is used and removed",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="repeats per row; each figure is their median (default 5: on a shared machine one "
        "repeat in five can be disturbed, and three leave the median exposed to it)",
    )
    parser.add_argument(
        "--steps-during",
        type=int,
        default=3,
        help="at least this many training steps after each async save call (steps continue until the save is durable)",
    )
    parser.add_argument(
        "--step-kind",
        choices=("auto", "model", "matmul"),
        default="auto",
        help="training step for stall measurement: a model fwd/bwd/AdamW step, "
        "a fixed CPU matmul loop, or auto (model if fast enough)",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=20.0,
        help="target duration of one matmul step (default 20 ms)",
    )
    parser.add_argument(
        "--max-model-step-s",
        type=float,
        default=0.1,
        help="auto picks the model step only when it takes at most this long",
    )
    parser.add_argument(
        "--baseline-steps",
        type=int,
        default=10,
        help="steps timed with no save in flight before and again after each async save "
        "(their mean is the baseline the steps during the save are compared with)",
    )
    parser.add_argument("--layers", type=int, default=32, help="Linear layers in the model")
    parser.add_argument(
        "--rss-saves",
        type=int,
        default=50,
        help="consecutive ftsup async saves for the RSS-growth check (0: off)",
    )
    parser.add_argument(
        "--reshard-ranks",
        type=int,
        default=None,
        help="world size the reshard loads run on (default ranks+1)",
    )
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="unmeasured saves before the async rows, reported as cold_*: one for DCP's, and for "
        "ftsup's as many as its engine takes to reach its steady state (keep_last + 1; after "
        "them every save writes over recycled shard files)",
    )
    parser.add_argument(
        "--recycle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ftsup writes over the shard files of checkpoints retention deleted (the engine's default)",
    )
    parser.add_argument(
        "--skip",
        nargs="+",
        default=[],
        choices=(*report.ROW_NAMES, "durable_stall"),
        metavar="ROW",
        help="rows not to run (reported as skipped)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="hard limit per group of ranks (default scales with size)",
    )
    parser.add_argument(
        "--process-timeout-s",
        type=float,
        default=120.0,
        help="hard limit for the dcp_async_process group (default 120)",
    )
    parser.add_argument(
        "--hf-max-shard-size",
        dest="hf_max_shard_bytes",
        type=_shard_size,
        default=100 * 10**6,
        metavar="SIZE",
        help="the shard size hf_export writes the model in, as the Hub's tools read it (default 100MB)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run folder")
    parser.add_argument(
        "--durable",
        metavar="s3://BUCKET/PREFIX",
        default=None,
        help="a durable tier on object storage for the durable rows (upload and restore of the newest ftsup "
        "checkpoint, each beside the plain S3 operation; endpoint and credentials from the standard AWS "
        "variables); without it those rows are not run",
    )
    parser.add_argument(
        "--durable-rounds", type=int, default=None, help="rounds of the durable rows (default: --repeats)"
    )
    parser.add_argument("--durable-part-mib", type=int, default=16, help="upload part size in MiB (default 16)")
    parser.add_argument("--durable-concurrency", type=int, default=8, help="requests in flight (default 8)")


def _shard_size(text: str) -> int:
    try:
        return hublayout.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _read_records(results_dir: Path, phase: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(results_dir.glob(f"{phase}-rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a rank killed mid-line: the lines before it still count
    return out


class _Run:
    """One benchmark run: its folder, the common spec, and what each group produced."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.dir = Path(args.dir).resolve() / f"ftsup-bench-{stamp}-{os.getpid()}"
        self.results = self.dir / "results"
        self.logs = self.dir / "logs"
        self.results.mkdir(parents=True)
        self.shape = shape_for(args.size_mb, args.layers)
        gib = max(args.size_mb / 1024, 1 / 64)
        self.timeout_s = args.timeout_s or 180 + gib * (args.repeats * 90 + args.rss_saves * 6)
        self.common = {
            "shape": self.shape.to_json(),
            "repeats": args.repeats,
            "warmup": args.warmup,
            "recycle": args.recycle,
            "steps_during": args.steps_during,
            "baseline_steps": args.baseline_steps,
            "step_kind": args.step_kind,
            "step_ms": args.step_ms,
            "max_model_step_s": args.max_model_step_s,
            "rss_saves": args.rss_saves,
            "save_timeout_s": max(60.0, gib * 120),
            "run_dir": str(self.dir),
            "results_dir": str(self.results),
        }
        self.groups: dict[str, dict[str, Any]] = {}
        self.records: dict[str, list[dict[str, Any]]] = {}

    def launch(self, phase: str, world: int, rows: list[str], timeout_s: float, **extra: Any) -> str:
        if not rows:
            self.groups[phase] = {"status": "not run", "world_size": world}
            return "not run"
        spec = {**self.common, **extra, "phase": phase, "rows": rows}
        spec_path = self.dir / f"spec-{phase}.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        _log(f"{phase}: {world} ranks, rows {', '.join(rows)} (limit {timeout_s:.0f}s)")
        outcome = launch.run_group(world, launch.rank_command(spec_path), self.logs, phase, timeout_s)
        _log(f"{phase}: {outcome.status} after {outcome.wall_s:.1f}s")
        self.groups[phase] = {
            "status": outcome.status,
            "world_size": world,
            "wall_s": outcome.wall_s,
            "exit_codes": [e.returncode for e in outcome.exits],
            "stopped_pids": list(outcome.stopped_pids),
            "leftover_pids": list(outcome.leftover_pids),
        }
        if not outcome.ok:
            for e in outcome.exits:
                tail = (self.logs / f"{phase}-rank{e.rank}.log").read_text(errors="replace")
                _log(f"{phase} rank {e.rank} exit {e.returncode}; log tail:\n{tail[-3000:]}")
        self.records[phase] = _read_records(self.results, phase)
        return outcome.status


def run(args: argparse.Namespace) -> int:
    """Run the whole benchmark; print the table, write --json. 0 unless a row broke."""
    if args.ranks < 1:
        raise SystemExit("--ranks must be at least 1")
    reshard = args.reshard_ranks or args.ranks + 1
    if reshard == args.ranks or reshard < 1:
        raise SystemExit("--reshard-ranks must differ from --ranks (and be at least 1)")
    run = _Run(args)
    skip = set(args.skip)
    not_run: dict[str, str] = {}
    section = durable_rows.not_run("no --durable tier given")
    try:
        _run_groups(run, args, reshard, skip, not_run)
        section = _durable(run, args)
    finally:
        data = _assemble(run, args, reshard, skip, not_run)
        data["durable"] = section
        data["ratios"].update(section["ratios"])
        data["targets"].update(section["targets"])
        # A hung process-mode group is an expected outcome; anything else keeps the logs.
        broken = [p for p, g in run.groups.items() if p != "process" and g["status"] not in ("ok", "not run")]
        if args.keep or broken:
            _log(f"run folder kept: {run.dir}")
        else:
            shutil.rmtree(run.dir, ignore_errors=True)
    print(report.table(data["results"], data["targets"]))
    print()
    print(durable_rows.table(data["durable"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        _log(f"wrote {args.json}")
    bad = [r["name"] for r in data["results"] + data["durable"]["rows"] if r["status"] in _BAD]
    if bad:
        _log(f"rows that did not complete: {', '.join(bad)}")
    return 1 if bad else 0


def _run_groups(run: _Run, args: argparse.Namespace, reshard: int, skip: set[str], not_run: dict[str, str]) -> None:
    """Main group, then reshard loads of what it wrote, the Hugging Face rows, then DCP's process mode, alone."""
    main_skip = set(skip)
    if args.rss_saves <= 0 or "ftsup_async" in skip:
        main_skip.add("ftsup_rss")
    main_rows = [r for r in MAIN_ROWS if r not in main_skip]
    run.launch("main", args.ranks, main_rows, run.timeout_s)
    main = report.combine(run.records.get("main", []))
    group = run.groups["main"]["status"]
    reshard_rows = []
    for r in RESHARD_ROWS:
        source = _SOURCES[r]
        if r in skip:
            continue
        status = "skipped" if source in skip else report.row_status(main.get(source), args.ranks, group)
        if status != "ok" or "reference" not in main.get(source, {}):
            not_run[r] = status
            continue
        reshard_rows.append(r)
    cfg = _config_from(run.records.get("main", []))
    pinned: dict[str, Any] = {"matmul_repeats": cfg.get("matmul_repeats")}
    if cfg.get("step_kind"):
        pinned["step_kind"] = cfg["step_kind"]
    refs = {
        "ftsup": main.get("ftsup_sync", {}).get("reference"),
        "dcp": main.get("dcp_save", {}).get("reference"),
    }
    gib = max(args.size_mb / 1024, 1 / 64)
    run.launch(
        "reshard",
        reshard,
        ["reshard_loads"] if reshard_rows else [],  # one row function interleaves both loads
        180 + gib * args.repeats * 90,
        references=refs,
        reshard_loads=reshard_rows,
        **pinned,
    )
    hf_rows = [r for r in hf_report.ROW_NAMES if r not in skip]
    run.launch(
        "hf",
        args.ranks,
        ["hf"] if hf_rows else [],
        180 + gib * args.repeats * 120,
        hf_rows=hf_rows,
        hf_max_shard_bytes=args.hf_max_shard_bytes,
        **pinned,
    )
    process_rows = [r for r in PROCESS_ROWS if r not in skip]
    run.launch("process", args.ranks, process_rows, args.process_timeout_s, **pinned)


def _durable(run: _Run, args: argparse.Namespace) -> dict[str, Any]:
    """The durable rows on the newest checkpoint the main group's ftsup rows committed."""
    if not args.durable:
        return durable_rows.not_run("no --durable tier given")
    from ftsup.store import durable

    source = durable_rows.newest_checkpoint(run.dir / "ftsup")
    if source is None:
        return durable_rows.not_run("the main group committed no ftsup checkpoint")
    rounds = args.durable_rounds or args.repeats
    options = durable.DurableOptions(part_bytes=args.durable_part_mib << 20, concurrency=args.durable_concurrency)
    _log(f"durable: {rounds} rounds on {source.name} at {args.durable}")
    try:
        section = durable_rows.run_rows(source, args.durable, rounds=rounds, options=options)
    except Exception as e:  # noqa: BLE001 - reported as the rows' error, the other rows stand
        _log(f"durable: failed: {type(e).__name__}: {e}")
        section = durable_rows.not_run(f"{type(e).__name__}: {e}", durable_rows.ROWS)
        for r in section["rows"]:
            r["status"] = "error"
    stall = _durable_stall(run, args)
    section["rows"] += stall["rows"]
    section["ratios"].update(stall["ratios"])
    section["targets"].update(stall["targets"])
    return section


def _durable_stall(run: _Run, args: argparse.Namespace) -> dict[str, Any]:
    """The stall rows (`durable_stall`): a group of the main group's size, its save with the tier's upload
    beside it and without."""
    if "durable_stall" in args.skip:
        return durable_rows.not_run("skipped", durable_rows.STALL_ROWS)
    gib = max(args.size_mb / 1024, 1 / 64)
    cfg = _config_from(run.records.get("main", []))
    pinned = {
        "matmul_repeats": cfg.get("matmul_repeats"),
        **({"step_kind": cfg["step_kind"]} if cfg.get("step_kind") else {}),
    }
    status = run.launch(
        "durable",
        args.ranks,
        ["durable_stall"],
        180 + gib * args.repeats * 120,
        durable_url=args.durable,
        durable_part_bytes=args.durable_part_mib << 20,
        durable_concurrency=args.durable_concurrency,
        **pinned,
    )
    return durable_rows.stall_rows(run.records.get("durable", []), args.ranks, status)


def _config_from(records: list[dict[str, Any]]) -> dict[str, Any]:
    configs = [r for r in records if r["row"] == "_config"]
    if not configs:
        return {}
    rank0 = min(configs, key=lambda r: r["rank"])
    return {
        "step_kind": rank0.get("step_kind"),
        "matmul_repeats": rank0.get("matmul_repeats"),
        "model_step_s": rank0.get("model_step_s"),
        "baseline_step_s": max(c["baseline_step_s"] for c in configs),
        "state_bytes": sum(c["local_bytes"] for c in configs),
        "torch_version": rank0.get("torch_version"),
    }


def _assemble(
    run: _Run, args: argparse.Namespace, reshard: int, skip: set[str], not_run: dict[str, str]
) -> dict[str, Any]:
    """Rows in the order of `MAIN_ROWS`, `RESHARD_ROWS` and `PROCESS_ROWS`, ratios, targets, config and how each
    group ended."""
    groups = {"main": args.ranks, "reshard": reshard, "process": args.ranks, "hf": args.ranks}
    rows_of = {"main": MAIN_ROWS, "reshard": RESHARD_ROWS, "process": PROCESS_ROWS, "hf": hf_report.ROW_NAMES}
    phase_of = {r: p for p, rows in rows_of.items() for r in rows}
    combined = {p: report.combine(run.records.get(p, [])) for p in groups}

    def status_of(name: str) -> str:
        if name in skip:
            return "skipped"
        if name in not_run:
            return "not available" if not_run[name] == "not available" else "not run"
        phase = phase_of[name]
        group = run.groups.get(phase, {"status": "not run"})["status"]
        if phase == "process" and group == "timeout":
            group = "hung"
        return report.row_status(combined[phase].get(name), groups[phase], group)

    rows: dict[str, dict[str, Any]] = {}
    for name in report.ROW_NAMES:
        phase = phase_of[name]
        if name == "raw_write":
            status = status_of(name)
            sub = {
                mode: report.result_row(f"raw_write.{mode}", combined[phase].get(f"raw_write.{mode}"), status)
                for mode in ("buffered", "direct")
            }
            rss = combined[phase].get("raw_write") or {}
            rows[name] = report.raw_write_row(sub["buffered"], sub["direct"], rss)
            rows[name]["status"] = status
            continue
        c = combined[phase].get(name)
        if c is not None and name == "ftsup_async" and "ftsup_rss" in combined[phase]:
            rss = combined[phase]["ftsup_rss"]
            c = {
                **c,
                "rss_growth_bytes": rss.get("rss_growth_bytes"),
                "rss_saves": rss.get("rss_saves"),
                "rss_status": status_of_rss(rss, args.ranks, run),
            }
        rows[name] = report.result_row(name, c, status_of(name))
        if not_run.get(name):
            rows[name]["error"] = f"its checkpoint source ended {not_run[name]!r}"
    ratio_values = report.ratios(rows)
    config = {
        "size_mb": args.size_mb,
        "ranks": args.ranks,
        "reshard_ranks": reshard,
        "dir": str(args.dir),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "recycle": args.recycle,
        "steps_during": args.steps_during,
        "rss_saves": args.rss_saves,
        "hf_max_shard_bytes": args.hf_max_shard_bytes,
        "layers": run.shape.layers,
        "width": run.shape.width,
        "planned_state_bytes": run.shape.state_bytes,
        "cache_dropped": _cache_dropped(run),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        **_config_from(run.records.get("main", [])),
    }
    return {
        "results": [rows[n] for n in report.ROW_NAMES],
        "config": config,
        "ratios": ratio_values,
        "targets": report.targets(ratio_values),
        "groups": run.groups,
    }


def status_of_rss(rss: dict[str, Any], ranks: int, run: _Run) -> str:
    return report.row_status(rss, ranks, run.groups.get("main", {}).get("status", "not run"))


def _cache_dropped(run: _Run) -> bool | None:
    seen = [r["cache_dropped"] for recs in run.records.values() for r in recs if r.get("cache_dropped") is not None]
    return all(seen) if seen else None
