"""The invariants `ftsup chaos` holds a run to, per fault and per job, as pure functions over what was recorded
(`inject`, `nodes`) and what the jobs left (loss logs, sample logs): each returns the violations it found, as lines
a person can act on (docs/benchmarks.md, "Chaos: every kind of fault, and the invariants after each").
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ftsup.tools.faults import chaos
from ftsup.tools.faults.inject import RESTART_KINDS

REL_TOL = 1e-4
DETECTED = RESTART_KINDS | {"node-loss", "evict-signal", "evict-metadata", "kill-supervisor"}
RESUMED = RESTART_KINDS | {"node-loss", "kill-supervisor", "evict-signal", "evict-metadata"}
NO_RESTART = frozenset({"straggler", "disk-full"})


def fault_violations(rec: dict[str, Any]) -> list[str]:
    """What went wrong with one fault (empty: every invariant held)."""
    kind = rec["kind"]
    if rec.get("error"):
        return [f"not observed to the end: {rec['error']}"]
    out: list[str] = []
    if kind in DETECTED and not rec.get("detected_by"):
        out.append("not detected")
    if kind in RESUMED:
        out += _resumed(rec)
    if kind in NO_RESTART and rec.get("restarted"):
        out.append(f"the job was restarted ({rec.get('failure')}), for a fault it should have ridden out")
    if kind == "kill-supervisor":
        if not rec.get("journal_adopted"):
            out.append("the restarted supervisor did not adopt the journal")
    if kind in ("kill-supervisor", "evict-signal", "evict-metadata", "node-loss") and rec.get("orphans"):
        out.append(f"processes outlived their supervisor: {rec['orphans']}")
    if kind in ("evict-signal", "evict-metadata"):
        out += _evicted(rec)
    if kind == "flip-byte":
        out += _flipped(rec)
    if kind == "stop-rank":
        out += _hang_recorded(rec)
    if kind == "kill-in-commit" and rec.get("loaded_step") in (rec.get("torn_steps") or ()):
        out.append(f"resumed from step {rec['loaded_step']}, whose commit the kill tore")
    if kind == "disk-full":
        if not rec.get("landed"):
            out.append("no save failed while the store was full: the fault did not land")
    if kind == "node-loss" and rec.get("rejoin_s") is None:
        out.append("the lost node never rejoined")
    return out


def _resumed(rec: dict[str, Any]) -> list[str]:
    out = []
    if rec.get("recover_s") is None:
        out.append("no step logged after the relaunch: not recovered")
    loaded, floor = rec.get("loaded_step"), rec.get("newest_before")
    if loaded is not None and floor is not None and loaded < floor:
        out.append(f"resumed from step {loaded}, older than the newest committed checkpoint {floor}: lost")
    if loaded and rec.get("loaded_consistent") is not True:
        out.append(f"resumed from step {loaded}, whose checkpoint does not verify: loaded corrupt or torn")
    if rec.get("stale_processes"):
        out.append(f"processes of an earlier attempt alive after the relaunch: {rec['stale_processes']}")
    return out


def _hang_recorded(rec: dict[str, Any]) -> list[str]:
    """A hang leaves an incident record, and it names the rank that was stopped."""
    if rec.get("incident") is None:
        return [f"no incident record of the hang of rank {rec.get('stopped_rank')}"]
    if rec.get("incident_rank") != rec.get("stopped_rank"):
        named = rec.get("incident_rank")
        why = f" ({rec['incident_why']})" if rec.get("incident_why") else ""
        return [
            f"incident {rec['incident']} names rank {named}{why}, not rank {rec.get('stopped_rank')} that was stopped"
        ]
    return []


def _evicted(rec: dict[str, Any]) -> list[str]:
    out = []
    if rec.get("exit_code") != 5:
        out.append(f"the evicted supervisor exited {rec.get('exit_code')}, not 5")
    if rec.get("lost_steps") not in (0, None):
        out.append(f"{rec['lost_steps']} step(s) trained again after an eviction (its emergency save lost them)")
    if rec.get("variant") == "azure" and rec.get("acknowledged") != 1:
        out.append(f"Azure's notice acknowledged {rec.get('acknowledged')} time(s), not once")
    return out


def _flipped(rec: dict[str, Any]) -> list[str]:
    out = []
    if not rec.get("landed"):
        out.append("a newer checkpoint was committed between the flip and the kill: the fault did not land")
    elif rec.get("loaded_step") == rec.get("flipped_step"):
        out.append(f"resumed from the flipped checkpoint {rec['flipped_step']}")
    elif not rec.get("quarantined"):
        out.append(f"the flipped checkpoint {rec.get('flipped_step')} was not quarantined")
    return out


# --------------------------------------------------------------------------- per job


def final_lines(path: Path) -> tuple[dict[int, dict[str, Any]], set[int]]:
    """Each step's last line of a loss log, and the worlds sizes every line was trained at."""
    final: dict[int, dict[str, Any]] = {}
    worlds: set[int] = set()
    for rec in chaos.json_lines(path):
        try:
            final[int(rec["step"])] = rec
            worlds.add(int(rec["world_size"]))
        except (KeyError, TypeError, ValueError):
            continue
    return final, worlds


def last_step(path: Path) -> int:
    """The highest step of a loss log (0 for none)."""
    final, _ = final_lines(path)
    return max(final, default=0)


def loss_log_check(reference: Path, got: Path, steps: int) -> dict[str, Any]:
    """The merged loss log against the uninterrupted one (see the module docstring)."""
    ref, _ = final_lines(reference)
    final, _ = final_lines(got)
    ref_world = next((r.get("world_size") for r in ref.values()), None)
    changed = min((int(r["step"]) for r in chaos.json_lines(got) if r.get("world_size") != ref_world), default=None)
    missing = [s for s in range(1, steps + 1) if s not in final or s not in ref]
    unequal, worst = [], 0.0
    for s in range(1, steps + 1):
        if s in missing:
            continue
        a, b = final[s], ref[s]
        if changed is None or s < changed:
            if a.get("loss_hex", repr(a.get("loss"))) != b.get("loss_hex", repr(b.get("loss"))):
                unequal.append(s)
            continue
        rel = abs(float(a["loss"]) - float(b["loss"])) / max(abs(float(b["loss"])), 1e-300)
        worst = max(worst, rel)
        if rel > REL_TOL:
            unequal.append(s)
    extra = sorted(s for s in final if not 1 <= s <= steps)
    violations = []
    if missing:
        violations.append(f"loss log: {len(missing)} step(s) missing: {missing[:10]}")
    if unequal:
        violations.append(f"loss log: {len(unequal)} step(s) differ from the uninterrupted run: {unequal[:10]}")
    if extra:
        violations.append(f"loss log: steps beyond the run: {extra[:10]}")
    return {
        "steps": steps,
        "bitwise_steps": (changed - 1) if changed is not None else steps,
        "world_size_changed_at": changed,
        "max_rel_diff": worst,
        "violations": violations,
    }


def sample_ids(loss_log: Path, sample_logs: Iterable[Path]) -> dict[int, list[int]]:
    """Each step's sample ids as trained by the attempt that last trained it: the ranks below that line's
    world size, each rank's last line for the step at that world size (every file appended to in order)."""
    final, _ = final_lines(loss_log)
    per_rank: dict[int, dict[tuple[int, int], list[int]]] = {}
    for path in sample_logs:
        for rec in chaos.json_lines(path):
            try:
                key = (int(rec["step"]), int(rec["world_size"]))
                per_rank.setdefault(int(rec["rank"]), {})[key] = [int(i) for i in rec["ids"]]
            except (KeyError, TypeError, ValueError):
                continue
    out: dict[int, list[int]] = {}
    for step, line in final.items():
        world = int(line.get("world_size", 0))
        parts = [per_rank.get(r, {}).get((step, world)) for r in range(world)]
        out[step] = sorted(i for p in parts if p is not None for i in p) if all(p is not None for p in parts) else []
    return out


def samples_check(reference: dict[int, list[int]], got: dict[int, list[int]], steps: int) -> dict[str, Any]:
    """Every step trained on the uninterrupted run's samples: none skipped, none repeated."""
    wrong = [s for s in range(1, steps + 1) if not got.get(s) or got.get(s) != reference.get(s)]
    repeated = sorted({i for s in range(1, steps + 1) for i in _repeats(got.get(s, []))})
    violations = []
    if wrong:
        violations.append(f"samples: {len(wrong)} step(s) trained on other samples (or not logged): {wrong[:10]}")
    if repeated:
        violations.append(f"samples: {len(repeated)} sample(s) repeated within a step: {repeated[:10]}")
    return {"steps_checked": steps, "samples": sum(len(v) for v in got.values()), "violations": violations}


def _repeats(ids: Sequence[int]) -> list[int]:
    return [a for a, b in zip(ids, ids[1:], strict=False) if a == b]  # sorted: a repeat is a neighbour


# --------------------------------------------------------------------------- the summary


def by_kind(records: Sequence[dict[str, Any]], kinds: Iterable[str]) -> list[dict[str, Any]]:
    """One row per kind: how many were thrown, their violations, median detection and recovery, steps redone."""
    rows = []
    for kind in kinds:
        recs = [r for r in records if r["kind"] == kind]
        redone = [r["lost_steps"] for r in recs if r.get("lost_steps") is not None]
        row = {
            "kind": kind,
            "count": len(recs),
            "violations": sum(len(r.get("violations", ())) for r in recs),
            "detect_s_median": _median(r.get("detect_s") for r in recs),
            "recover_s_median": _median(r.get("recover_s") for r in recs),
            "steps_redone_median": _median(r.get("lost_steps") for r in recs),
            "steps_redone_max": max(redone, default=None),
        }
        rows.append(row)
    return rows


def _median(values: Iterable[Any]) -> float | None:
    got = [float(v) for v in values if v is not None]
    return round(statistics.median(got), 3) if got else None
