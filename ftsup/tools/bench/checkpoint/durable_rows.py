"""The durable rows of `ftsup bench checkpoint`: upload to and restore from a durable tier on object storage, each
beside the plain S3 operation on the same bytes, with the same client and concurrency. Torch-free, run in the
benchmark's parent on the newest checkpoint its ftsup rows committed; what each row and ratio measures:
docs/benchmarks.md, "The durable tier against plain S3".
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ftsup.store import durable, layout

ROWS = ("durable_upload", "s3_upload", "durable_restore", "s3_ranged_get")
READ_PAIRS = 3
"""Pairs of the read rows per round, their order alternating: a read is much quicker than an upload, so the
restore's ratio gets three times the pairs for little more time a round."""
STALL_ROWS = ("ftsup_async_durable", "ftsup_async_alone")
"""Measured in the ranks (`durable_stall`): ftsup's async save with the tier's upload running beside it, and alone."""
TARGETS = {
    "durable_upload_vs_plain": (">=", 0.9),
    "durable_restore_vs_plain": (">=", 0.9),
    "durable_stall_vs_alone": ("<=", 1.1),
}
_PAIRS = {
    "durable_upload_vs_plain": ("s3_upload", "durable_upload"),
    "durable_restore_vs_plain": ("s3_ranged_get", "durable_restore"),
}
_STALL_FIELDS = ("stall_s", "block_s", "extra_step_s", "durable_s", "baseline_step_s")


def newest_checkpoint(root: Path) -> Path | None:
    """The newest committed checkpoint directory under `root` (a store the main group's ftsup rows wrote)."""
    dirs = layout.committed_dirs(root) if root.is_dir() else []
    return max(dirs)[1] if dirs else None


def run_rows(source: Path, url: str, *, rounds: int, options: durable.DurableOptions) -> dict[str, Any]:
    """Every row `rounds` times on the checkpoint `source`, at the tier `url`; the rows, ratios and targets."""
    location = durable.parse_location(url)
    if not location.is_s3:
        raise SystemExit(f"--durable {url}: the durable rows measure object storage; give s3://BUCKET/PREFIX")
    local = durable.read_local(source)
    nbytes = sum(e.size for e in local.manifest.files.values())
    seconds: dict[str, list[float]] = {r: [] for r in ROWS}
    ratios: dict[str, list[float]] = {name: [] for name in _PAIRS}
    tag = f"ftsup-bench-{os.getpid()}-{time.strftime('%Y%m%d%H%M%S')}"
    for i in range(-1, rounds):  # round -1: unmeasured, the connections and the store warmed up
        base = f"{location.url.rstrip('/')}/{tag}/round-{i + 1}"
        ftsup_first = i % 2 == 0
        with durable.open_tier(f"{base}/ftsup", options) as opened:
            tier: Any = opened  # an S3Tier: its client is the plain rows' too
            s3 = _Plain(tier, local, f"{tier.location.prefix}-plain")
            try:
                order = [("durable_upload", functools.partial(tier.upload, source)), ("s3_upload", s3.upload)]
                for name, fn in order if ftsup_first else order[::-1]:
                    seconds[name].append(_timed(fn))
                os.sync()  # the store's writes on disk: their writeback is in none of the timed reads
                restore = functools.partial(_restore, tier, local)
                order = [("durable_restore", restore), ("s3_ranged_get", s3.ranged_get)]
                for k in range(READ_PAIRS):
                    for name, fn in order if (i + k) % 2 == 0 else order[::-1]:
                        seconds[name].append(_timed(fn))
            finally:
                s3.delete()
                tier.delete(local.manifest.step)
        if i < 0:
            for v in seconds.values():
                v.clear()
            continue
        for name, (plain, ours) in _PAIRS.items():
            n = READ_PAIRS if ours == "durable_restore" else 1
            ratios[name] += [a / b for a, b in zip(seconds[plain][-n:], seconds[ours][-n:], strict=True)]
    rows = [
        {
            "name": r,
            "status": "ok",
            "seconds": statistics.median(seconds[r]),
            "seconds_each": [round(s, 4) for s in seconds[r]],
            "bytes": nbytes,
            "mib_per_s": nbytes / statistics.median(seconds[r]) / 2**20,
        }
        for r in ROWS
    ]
    values = {name: statistics.median(v) for name, v in ratios.items()}
    targets = {name: _target(name, values[name], ratios[name]) for name in _PAIRS}
    config = {
        "url": location.url,
        "rounds": rounds,
        "part_bytes": options.part_bytes,
        "concurrency": options.concurrency,
        "files": len(local.manifest.files),
        "bytes": nbytes,
        "checkpoint": str(source),
    }
    return {"rows": rows, "ratios": values, "targets": targets, "config": config}


def _target(name: str, value: float | None, each: list[float]) -> dict[str, Any]:
    op, limit = TARGETS[name]
    met = None if value is None else (value >= limit if op == ">=" else value <= limit)
    return {"value": value, "target": f"{op} {limit:g}", "met": met, "each": [round(v, 3) for v in each]}


def not_run(why: str, names: tuple[str, ...] = ROWS + STALL_ROWS) -> dict[str, Any]:
    """The durable section (or the part of it that `names` are) of a run that did not measure it, and why."""
    rows = [{"name": r, "status": "not run", "error": why} for r in names]
    wanted = [n for n in TARGETS if set(_PAIRS.get(n, STALL_ROWS)) <= set(names)]
    targets = {n: _target(n, None, []) for n in wanted}
    return {"rows": rows, "ratios": dict.fromkeys(wanted), "targets": targets, "config": {}}


def stall_rows(records: list[dict[str, Any]], world: int, group_status: str) -> dict[str, Any]:
    """The stall part of the durable section from the ranks' records (`durable_stall`): each row's medians over
    repeats of its figures (the largest over ranks in each repeat), and the ratio, the median over repeats of each
    repeat's stall with the upload over the stall without."""
    by: dict[str, dict[int, list[dict[str, Any]]]] = {r: {} for r in STALL_ROWS}
    finals: dict[str, list[dict[str, Any]]] = {r: [] for r in STALL_ROWS}
    for rec in records:
        if rec.get("row") in by:
            if isinstance(rec.get("repeat"), int):
                by[rec["row"]].setdefault(rec["repeat"], []).append(rec)
            elif rec.get("repeat") is None:
                finals[rec["row"]].append(rec)
    rows, each = [], {}
    for name in STALL_ROWS:
        errors = [r["error"] for r in finals[name] if r.get("error")]
        done = sum(1 for r in finals[name] if r.get("status") == "ok")
        repeats = {i: recs for i, recs in sorted(by[name].items()) if len(recs) == world}
        if done < world or not repeats:
            status = group_status if group_status != "ok" else "incomplete"
            error = errors[0] if errors else f"the group ended {group_status!r}"
            rows.append({"name": name, "status": "error" if errors else status, "error": error})
            continue
        per = {
            i: {f: max(r[f] for r in recs if r.get(f) is not None) for f in _STALL_FIELDS}
            for i, recs in repeats.items()
        }
        each[name] = {i: p["stall_s"] for i, p in per.items()}
        row: dict[str, Any] = {"name": name, "status": "ok", "repeats": len(per)}
        row.update({f: statistics.median(p[f] for p in per.values()) for f in _STALL_FIELDS})
        row["stall_each"] = [round(p["stall_s"], 4) for p in per.values()]
        row["bytes"] = max((r.get("bytes") or 0) for recs in repeats.values() for r in recs)
        if name == STALL_ROWS[0]:
            overlapped = [r["upload_overlapped"] for recs in repeats.values() for r in recs if "upload_overlapped" in r]
            row["upload_overlapped"] = f"{sum(overlapped)}/{len(overlapped)}"
            row["upload_s"] = statistics.median(
                r["upload_s"] for recs in repeats.values() for r in recs if "upload_s" in r
            )
            cpu = [r["upload_cpu_s"] for recs in repeats.values() for r in recs if "upload_cpu_s" in r]
            if cpu:
                row["upload_cpu_s"] = statistics.median(cpu)
        rows.append(row)
    pairs = sorted(set(each.get(STALL_ROWS[0], {})) & set(each.get(STALL_ROWS[1], {})))
    ratios = [each[STALL_ROWS[0]][i] / each[STALL_ROWS[1]][i] for i in pairs if each[STALL_ROWS[1]][i] > 0]
    value = statistics.median(ratios) if ratios else None
    return {
        "rows": rows,
        "ratios": {"durable_stall_vs_alone": value},
        "targets": {"durable_stall_vs_alone": _target("durable_stall_vs_alone", value, ratios)},
    }


def table(section: dict[str, Any]) -> str:
    lines = [f"{'durable row':<20} {'status':<10} {'seconds':>8} {'MiB/s':>8}  each"]
    for r in section["rows"]:
        if r["status"] == "ok" and "stall_s" in r:
            lines.append(
                f"{r['name']:<20} {r['status']:<10} {r['stall_s']:>8.3f} {'stall':>8}  "
                f"{' '.join(f'{s:.3f}' for s in r['stall_each'])}"
            )
            continue
        if r["status"] != "ok":
            lines.append(f"{r['name']:<20} {r['status']:<10} {'-':>8} {'-':>8}  {r.get('error', '')}")
            continue
        lines.append(
            f"{r['name']:<20} {r['status']:<10} {r['seconds']:>8.3f} {r['mib_per_s']:>8.1f}  "
            f"{' '.join(f'{s:.3f}' for s in r['seconds_each'])}"
        )
    return "\n".join(lines)


def _restore(tier: durable.DurableTier, local: durable.LocalCheckpoint) -> None:
    problems = tier.read_files(local.manifest.step, local.token, local.manifest)
    if problems:
        raise SystemExit(f"durable_restore: the tier gave back other bytes: {problems[0]}")


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Plain:
    """The plain S3 operations on the checkpoint's files, through the tier's own client (same configuration, same
    connection pool), under `prefix`."""

    def __init__(self, tier: Any, local: durable.LocalCheckpoint, prefix: str) -> None:
        self.client = tier.client
        self.bucket = tier.bucket
        self.options: durable.DurableOptions = tier.options
        self.local = local
        self.prefix = prefix
        self.keys: list[str] = []

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def _pool(self, jobs: list[Any]) -> None:
        durable.run_all(jobs, self.options.concurrency, "bench-plain")

    def _read(self, rel: str, offset: int, length: int) -> bytes:
        with open(self.local.path / rel, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def upload(self) -> None:
        part_bytes = self.options.part_bytes
        jobs: list[Any] = []
        multipart: dict[str, tuple[str, list[tuple[int, int]]]] = {}
        for rel, entry in sorted(self.local.manifest.files.items()):
            key = self._key(rel)
            self.keys.append(key)
            plan = durable.part_plan(entry.size, part_bytes)
            if len(plan) == 1:
                jobs.append(functools.partial(self._put, key, rel, entry.size))
                continue
            upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
            multipart[key] = (upload_id, plan)
        etags: dict[tuple[str, int], str] = {}

        def part(key: str, rel: str, upload_id: str, number: int, offset: int, length: int) -> None:
            got = self.client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=self._read(rel, offset, length)
            )
            etags[(key, number)] = got["ETag"]

        for rel in sorted(self.local.manifest.files):
            key = self._key(rel)
            if key in multipart:
                upload_id, plan = multipart[key]
                for number, (offset, length) in enumerate(plan, 1):
                    jobs.append(functools.partial(part, key, rel, upload_id, number, offset, length))
        self._pool(jobs)
        for key, (upload_id, plan) in multipart.items():
            parts = [{"PartNumber": n, "ETag": etags[(key, n)]} for n in range(1, len(plan) + 1)]
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )

    def _put(self, key: str, rel: str, size: int) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=self._read(rel, 0, size))

    def _get(self, key: str, offset: int, length: int) -> None:
        got = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
        got["Body"].read()

    def ranged_get(self) -> None:
        chunk = durable.READ_CHUNK_BYTES
        jobs = [
            functools.partial(self._get, self._key(rel), off, min(chunk, entry.size - off))
            for rel, entry in sorted(self.local.manifest.files.items())
            for off in range(0, entry.size, chunk)
        ]
        self._pool(jobs)

    def delete(self) -> None:
        for start in range(0, len(self.keys), 1000):
            batch = [{"Key": k} for k in self.keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        self.keys.clear()
