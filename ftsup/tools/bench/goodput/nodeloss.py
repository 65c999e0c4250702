"""`ftsup bench node-loss`'s pure part: when the node losses are due (the goodput bench's seeded schedule), what
each cost as read from the loss log (steps lost, recovery, the rejoin), which tier each resume read, the accounting
`Timeline`, and the rows, checks and table. No clock, no processes.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftsup.tools.bench.goodput import schedule
from ftsup.tools.bench.goodput.account import OTHER, Account, Interruption, Line, Timeline

_LOADED = re.compile(r"checkpoint_loaded\b(?P<rest>.*)")
_NODE_READ = re.compile(r"checkpoint_node_read\b(?P<rest>.*)")
_FIELD = re.compile(r"\b(step|tier|rank|durable_files)=(\S+)")


@dataclass(frozen=True)
class StepLine:
    """A loss-log line: `step` completed at wall time `t` by a job of `world_size` ranks."""

    t: float
    step: int
    world_size: int


@dataclass(frozen=True)
class Loss:
    """A node loss as the bench delivered it: node B killed at `t`, when the log's last line was of step
    `max_step_before`; its replacement started at `back_t` (None: never)."""

    t: float
    max_step_before: int
    back_t: float | None


def loss_times(seed: int, mean_interval_s: float, count: int, horizon_s: float) -> list[float]:
    """The first `count` node losses' offsets from the first launch: the goodput bench's schedule, kills only."""
    faults = schedule.plan(seed, mean_interval_s, {"kill": 1.0}, nproc=1, horizon_s=horizon_s)
    return [f.at_s for f in faults[:count]]


def _first(lines: Sequence[StepLine], after: float, world_size: int | None = None) -> StepLine | None:
    return next((ln for ln in lines if ln.t > after and (world_size is None or ln.world_size == world_size)), None)


def resumed(lines: Sequence[StepLine], loss: Loss) -> tuple[StepLine | None, int, float]:
    """The first line of the job again after `loss`, the newest step reached before it and when the job stopped.
    Lines seen after the loss that go on from the step before at both nodes' world size were written before it
    (the log is read every few tens of milliseconds): the first line again is the first that does not."""
    reached, stopped = loss.max_step_before, loss.t
    for ln in lines:
        if ln.t <= loss.t:
            continue
        if ln.world_size == 2 and ln.step == reached + 1:
            reached, stopped = ln.step, ln.t
            continue
        return ln, reached, stopped
    return None, reached, stopped


def per_loss(lines: Sequence[StepLine], loss: Loss, t0: float) -> dict[str, Any]:
    """What one loss cost: the first step after it (the survivor alone or the job again), the steps trained again
    then and at the rejoin, the time from the loss to that first step, and from the replacement's start to the
    first step of both nodes again. A mark never seen is None."""
    first, reached, _ = resumed(lines, loss)
    rejoin = _first(lines, loss.back_t, 2) if loss.back_t is not None else None
    # where training was just before the rejoin (the survivor's last step), not the most it ever reached
    before_rejoin = next((ln.step for ln in reversed(lines) if rejoin is not None and ln.t < rejoin.t), 0)
    lost = None if first is None else max(0, reached - (first.step - 1))
    if rejoin is first or rejoin is None:  # one restart for the loss and the rejoin; or the job ended before it
        lost_rejoin: int | None = 0
    else:
        lost_rejoin = None if rejoin is None else max(0, before_rejoin - (rejoin.step - 1))
    return {
        "at_s": round(loss.t - t0, 3),
        "max_step_before": reached,
        "first_step": None if first is None else first.step,
        "world_size_after": None if first is None else first.world_size,
        "recover_s": None if first is None else round(first.t - loss.t, 3),
        "lost_steps": lost,
        "rejoin_s": None if rejoin is None or loss.back_t is None else round(rejoin.t - loss.back_t, 3),
        "rejoined_at_step": None if rejoin is None else rejoin.step,
        "lost_steps_rejoin": 0 if rejoin is first else lost_rejoin,
        "lost_steps_total": None
        if lost is None or (lost_rejoin is None and rejoin is not first)
        else lost + (lost_rejoin or 0),
    }


def timeline(lines: Sequence[StepLine], losses: Sequence[Loss], t0: float, end: float, save_every: int) -> Timeline:
    """The accounting's timeline: each loss a `kill` (from the last line written before it); every other restart
    seen in the log (a line that does not go on from the one before at the same world size: the rejoin's, or one
    more while the rendezvous settles) `other`, from the line before it."""
    cuts = [Interruption(resumed(lines, loss)[2], "kill") for loss in losses]
    ordered = sorted(lines, key=lambda ln: ln.t)
    for prev, ln in zip(ordered, ordered[1:], strict=False):
        restarted = ln.step != prev.step + 1 or ln.world_size != prev.world_size
        if restarted and not any(prev.t <= c.t < ln.t for c in cuts):
            cuts.append(Interruption(prev.t, OTHER))
    return Timeline(
        start=t0,
        end=end,
        lines=tuple(Line(ln.t, ln.step) for ln in ordered),
        interruptions=tuple(sorted(cuts, key=lambda c: c.t)),
        save_every=save_every,
    )


def loads(text: str) -> list[dict[str, Any]]:
    """Every `checkpoint_loaded` a rank printed in `text`, in order: {step, tier, rank} (those given). A load of a
    node-local store that read files from the durable tier (its `checkpoint_node_read` says `durable_files`) is
    the durable tier's, though the rank logs the local path's tier."""
    out = []
    from_store: dict[tuple[Any, Any], int] = {}
    for line in text.splitlines():
        m = _NODE_READ.search(line)
        if m is not None:
            fields = dict(_FIELD.findall(m.group("rest")))
            from_store[(fields.get("rank"), fields.get("step"))] = (
                int(fields["durable_files"]) if fields.get("durable_files", "").isdigit() else 0
            )
            continue
        m = _LOADED.search(line)
        if m is None:
            continue
        fields = dict(_FIELD.findall(m.group("rest")))
        tier = fields.get("tier")
        if from_store.pop((fields.get("rank"), fields.get("step")), 0) > 0:
            tier = "durable"
        rec: dict[str, Any] = {"tier": tier}
        for name in ("step", "rank"):
            if fields.get(name, "").isdigit():
                rec[name] = int(fields[name])
        out.append(rec)
    return out


def _median(values: Sequence[float | int | None]) -> float | None:
    got = [float(v) for v in values if v is not None]
    return round(statistics.median(got), 3) if got else None


def row(
    name: str, command: str, acc: Account, losses: list[dict[str, Any]], tiers: list[dict[str, Any]], **run: Any
) -> dict[str, Any]:
    """One contender's row: the accounting, every loss's figures and their medians, the resumes' tiers."""
    return {
        "name": name,
        "command": command,
        **acc.to_dict(),
        "losses": losses,
        "losses_delivered": len(losses),
        "lost_steps_median": _median([x["lost_steps_total"] for x in losses]),
        "recover_s_median": _median([x["recover_s"] for x in losses]),
        "rejoin_s_median": _median([x["rejoin_s"] for x in losses]),
        "resume_tiers": sorted({str(t["tier"]) for t in tiers}),
        "loads": tiers,
        **run,
        "not_run": None,
    }


def not_run(name: str, command: str, reason: str) -> dict[str, Any]:
    return {"name": name, "command": command, "goodput": None, "not_run": reason}


def checks(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The target: ftsup with the peer tier above ftsup without it and above every other contender (null where a
    row needed did not run or measured nothing). A row whose job did not complete is below one that did, whatever
    its goodput so far: its wall time ended early."""
    by = {r["name"]: r for r in rows}
    peers = by.get("ftsup-peers", {})
    mine, done = peers.get("goodput"), bool(peers.get("completed"))
    out = {}
    for name, r in by.items():
        if name == "ftsup-peers":
            continue
        other = r.get("goodput")
        margin = None if mine is None or other is None else round(mine - other, 4)
        verdict = None if margin is None else margin > 0
        if margin is not None and done != bool(r.get("completed")):
            verdict = done
        key = f"peers_over_{name.replace('-', '_')}"
        out[key] = {"margin": margin, "completed": [done, bool(r.get("completed"))], "pass": verdict}
    return out


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def table(out: Mapping[str, Any]) -> str:
    """The results as a person reads them: one line per contender, then the commands and the checks."""
    head = ["contender", "goodput", "productive_s", "wall_s", "lost/loss", "recover_s", "rejoin_s", "tiers", "done"]
    lines = [head]
    for r in out["results"]:
        if r.get("not_run"):
            lines.append([r["name"], "not run: " + r["not_run"]])
            continue
        lines.append(
            [
                r["name"],
                _fmt(r["goodput"]),
                _fmt(r["productive_s"], 1),
                _fmt(r["wall_s"], 1),
                _fmt(r["lost_steps_median"], 1),
                _fmt(r["recover_s_median"], 1),
                _fmt(r["rejoin_s_median"], 1),
                ",".join(r["resume_tiers"]) or "-",
                "yes" if r["completed"] else "no",
            ]
        )
    widths = [max(len(x[i]) for x in lines if len(x) > i and len(x) == len(head)) for i in range(len(head))]
    text = ["", *("  ".join(c.ljust(w) for c, w in zip(x, widths, strict=False)).rstrip() for x in lines), ""]
    text.append("lost/loss, recover_s, rejoin_s: medians over the losses (steps trained again, loss to the first")
    text.append("step again, replacement's start to both nodes training); tiers: what the resumes read")
    for r in out["results"]:
        text.append(f"{r['name']}: {r['command']}")
    text.append(f"losses: {out.get('schedule', {}).get('description', '-')}")
    text.append("checks:")
    for name, c in out.get("checks", {}).items():
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[c.get("pass")]
        text.append(f"  {name}: {verdict} {json.dumps({k: v for k, v in c.items() if k != 'pass'})}")
    return "\n".join(text)
