"""What the ranks' save figures tell the policy, pure: the newest checkpoint committed, an eviction's emergency save
(committed, written to the fallback directory, or failed) and the exit status the eviction ends with, a checkpoint
directory made again (docs/design/policy.md, The emergency save).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ftsup.protocol import (
    COMMITTED_STEP,
    DIR_RECREATED_STEP,
    FALLBACK_STEP,
    MAX_STEP,
    MEMORY_STEP,
    PEERS_STEP,
    SAVE_FAILED_STEP,
    SAVED_STEP,
    STOPPED_ELSEWHERE_STEP,
)
from ftsup.supervisor.policy.events import AckEviction, Action, CheckpointCommitted, Exit, Heartbeat, Log, log

EXIT_EVICTED = 5
# The tiers an emergency checkpoint can reach, in the order the save tries them; a metric label's fixed values.
TIERS = ("memory", "peers", "disk", "fallback", "durable")
EXIT_SAVE_LOST = 8  # evicted, and no tier that outlives the node holds the emergency checkpoint: its steps are lost
# What an emergency checkpoint in each tier outlives, the tier that outlives most first (docs/evictions-and-durable.md,
# What the exit status says).
OUTLIVES = (
    ("durable", "the job's nodes"),
    ("fallback", "a reboot of this node (the job's nodes, once durable)"),
    ("peers", "this node's loss (not the loss of the peers that hold it)"),
    ("disk", "a reboot of this node (its loss too only where checkpoint.dir is shared)"),
    ("memory", "the ranks' processes, not the node: a relaunch on this node reads it, a new node does not"),
)


@dataclass(frozen=True)
class Eviction:
    source: str
    deadline: float
    noticed_at: float
    save_seq: int | None  # None: no save was requested (no time for one)
    committed_step: int | None = None
    fallback: bool = False  # committed in the fallback directory, not the store: it counts once it is durable
    failed: bool = False  # emergency_save_failed was logged
    # Each tier a save reached since the notice: (tier, step, seconds before the deadline), in the order seen.
    landed: tuple[tuple[str, int, float | None], ...] = ()

    def land(self, tier: str, step: int, now: float | None) -> Eviction:
        """This eviction with `step` seen in `tier` (kept once per tier: its newest step, when first seen so)."""
        left = None if now is None else round(self.deadline - now, 3)
        if any(t == tier and s >= step for t, s, _ in self.landed):
            return self
        return replace(self, landed=(*(x for x in self.landed if x[0] != tier), (tier, step, left)))


def step_figure(ev: Heartbeat, name: str) -> int | None:
    """The figure `name` of a beat as a step, or None (absent, or not a step number: a beat is the rank's word)."""
    value = ev.figure(name)
    return int(value) if value is not None and math.isfinite(value) and 0 <= value <= MAX_STEP else None


def newest_committed(newest: int | None, ev: Heartbeat) -> int | None:
    """The newest checkpoint committed in the store, with what the beat `ev` says was committed."""
    steps = [s for s in (newest, step_figure(ev, COMMITTED_STEP), step_figure(ev, SAVED_STEP)) if s is not None]
    return max(steps) if steps else None


def on_beat(
    ej: Eviction | None,
    ev: Heartbeat,
    attempt: int,
    newest: int | None,
    save_s: float | None,
    now: float | None = None,
) -> tuple[Eviction | None, list[Action]]:
    """What a beat's save figures mean; only the first local rank's count (every rank reports the same save)."""
    if ev.local_rank != 0:
        return ej, []
    if ej is not None and ej.save_seq is not None:
        for tier, figure in (("memory", MEMORY_STEP), ("peers", PEERS_STEP)):
            if (there := step_figure(ev, figure)) is not None:
                ej = ej.land(tier, there, now)
    actions: list[Action] = []
    if (made := step_figure(ev, DIR_RECREATED_STEP)) is not None:
        why = "the checkpoint directory had vanished; the ranks' save made it again (the checkpoints in it are gone)"
        actions.append(log("checkpoint_dir_recreated", "warning", attempt=attempt, step=made, reason=why))
    saved, elsewhere = step_figure(ev, SAVED_STEP), step_figure(ev, FALLBACK_STEP)
    failed = step_figure(ev, SAVE_FAILED_STEP)
    if ej is None or ej.committed_step is not None:  # no eviction's save waits (an advisory notice's save fails)
        if failed is not None and ej is None:  # training goes on: these steps would be lost if the node went now
            why = "the save asked for failed at the ranks"
            actions.append(_failed_log(attempt, failed, newest, failed, why, "warning"))
        return ej, actions
    step = saved if saved is not None else elsewhere
    if step is not None:
        fields = {"attempt": attempt, "step": step, "kind": "emergency", "duration_s": round(save_s or 0.0, 3)}
        reason = f"eviction: {ej.source}"
        if saved is None:
            reason += "; checkpoint.dir refused it: committed in checkpoint.durable.fallback_dir, kept once durable"
        level = "info" if saved is not None else "warning"
        ej = ej.land("disk" if saved is not None else "fallback", step, now)
        return replace(ej, committed_step=step, fallback=saved is None), [
            *actions,
            log("checkpoint_committed", level, reason=reason, fallback=saved is None, **fields),
            CheckpointCommitted(step, "emergency", fallback=saved is None),
            AckEviction(ej.source),
        ]
    if failed is not None and not ej.failed:
        held = kept(ej, newest)
        why = "the ranks' emergency save failed" + (PEERS_HOLD if held != newest and lost(held, failed) is None else "")
        actions.append(_failed_log(attempt, failed, held, failed, why))
        return replace(ej, failed=True), actions
    return ej, actions


def elsewhere(before: int | None, ev: Heartbeat) -> int | None:
    """The step after which the ranks stop at another node's request (its eviction), with what the beat `ev` says:
    their exit 0 then ends no job (the job goes on without that node, or with the one that replaces it)."""
    there = step_figure(ev, STOPPED_ELSEWHERE_STEP)
    return before if there is None else there


def rejoining(attempt: int, step: int) -> Log:
    """The log line of an attempt whose ranks stopped for another node's eviction, relaunched at once."""
    why = f"the ranks stopped after step {step} at another node's request (an eviction there), not at the job's end"
    why += ": relaunched at once, to resume with the nodes the rendezvous gathers"
    return log("peer_eviction_followed", "warning", attempt=attempt, step=step, reason=why)


def kept(ej: Eviction, newest: int | None) -> int | None:
    """The newest checkpoint that outlives the node's loss without the disk: the newest committed in the store, or
    the step the peers' memories hold since the notice (every replica verified), whichever is newer."""
    steps = [s for s in (newest, *(s for t, s, _ in ej.landed if t == "peers")) if s is not None]
    return max(steps) if steps else None


PEERS_HOLD = "; the peers' memories hold it, which outlive this node's loss"
ONLY_IN_MEMORY = "reached this node's memory only, which does not outlive the node"
MEMORY_ONLY = f"; it {ONLY_IN_MEMORY}"
NO_SAVE_PATH = "the script has no emergency save (no rank of the job ever reported a save or a checkpoint)"


def at_exit(
    ej: Eviction,
    final: Exit,
    attempt: int,
    newest: int | None,
    reached: int,
    stop_reason: str | None,
    *,
    saves_seen: bool = True,
) -> tuple[Eviction, list[Action], Exit]:
    """The exit an eviction ends with once its workers are gone: 5 when its save committed on disk, or reached the
    peers' memories (which outlive this node's loss), or none was asked for (no time for one, nothing trained), else
    8 (`EXIT_SAVE_LOST`) naming the steps lost, unless none is: a checkpoint in this node's memory only is lost with
    the node. Without `saves_seen` (no rank of the job reported a save or a checkpoint: a script that only counts its
    steps, such as an auto-instrumented one) the reason says plainly that the script has no emergency save."""
    if final.code != EXIT_EVICTED or ej.save_seq is None or ej.committed_step is not None:
        return ej, [], final
    held = kept(ej, newest)
    if held != newest and lost(held, reached) is None:  # not on disk, and lost with no node but those peers
        why = f"the emergency checkpoint of step {held} did not commit on disk{PEERS_HOLD}: no step is lost"
        return ej, [], Exit(EXIT_EVICTED, f"{final.reason}; {why}")
    actions: list[Action] = []
    in_memory = any(t == "memory" and s >= reached for t, s, _ in ej.landed)
    if not ej.failed:
        why = "the workers ended without reporting it committed"
        if stop_reason is not None and "deadline" in stop_reason:
            why = "it did not commit before the eviction deadline"
        if not saves_seen:
            why = NO_SAVE_PATH
        actions.append(_failed_log(attempt, max(reached, 0), held, reached, why + (MEMORY_ONLY if in_memory else "")))
    failed = f"the emergency checkpoint {ONLY_IN_MEMORY}" if in_memory else "the emergency save failed"
    return replace(ej, failed=True), actions, lost_exit(final, held, reached, failed)


def not_durable(ej: Eviction, final: Exit, attempt: int, newest: int | None, reached: int) -> tuple[list[Action], Exit]:
    """The exit of an eviction whose emergency checkpoint is only in the fallback directory and did not reach the
    durable tier before the deadline: nothing reads it there, so its steps are lost (8), unless the peers' memories
    hold it (5)."""
    step = ej.committed_step if ej.committed_step is not None else reached
    if (held := kept(ej, newest)) != newest and lost(held, max(step, reached)) is None:
        why = f"the emergency checkpoint of step {held} did not become durable{PEERS_HOLD}: no step is lost"
        return [], Exit(EXIT_EVICTED, f"{final.reason}; {why}")
    why = "it was committed in the fallback directory only, and did not reach the durable tier before the deadline"
    return [_failed_log(attempt, step, newest, max(step, reached), why)], lost_exit(final, newest, max(step, reached))


def lost(newest: int | None, reached: int) -> tuple[int, int] | None:
    """The steps an eviction loses: those after the newest checkpoint up to the step reached (None: none)."""
    first = 1 if newest is None else newest + 1
    return (first, reached) if reached >= first else None


def lost_exit(final: Exit, newest: int | None, reached: int, failed: str = "the emergency save failed") -> Exit:
    steps = lost(newest, reached)
    if steps is None:  # the newest checkpoint holds the step reached: nothing is lost
        return final
    where = "no checkpoint" if newest is None else f"the newest checkpoint, step {newest}"
    why = f"{failed}: steps {steps[0]}-{steps[1]}, after {where}, are lost"
    return Exit(EXIT_SAVE_LOST, f"{final.reason}; {why}")


def _failed_log(attempt: int, step: int, newest: int | None, reached: int, why: str, level: str = "error") -> Action:
    steps = lost(newest, reached)
    verb = "are lost" if level == "error" else "would be lost to an eviction now"
    told = f"steps {steps[0]}-{steps[1]} {verb}" if steps else "no step is lost"
    since = "no checkpoint" if newest is None else f"the newest checkpoint is step {newest}"
    return log(
        "emergency_save_failed",
        level,
        attempt=attempt,
        step=step,
        checkpoint_step=newest,
        lost_steps=list(steps) if steps else [],
        reason=f"the emergency save of step {step} failed: {why}; {told} ({since})",
    )


def tiers_reached(ej: Eviction, attempt: int, reached: int, durable: bool | None) -> Log | None:
    """The log line (`emergency_tiers_reached`) of the tiers the eviction's emergency checkpoint reached before the
    node was lost, in the order the save tried them, with the seconds each had left before the deadline; None when
    no save was asked for. `durable`: whether it became durable (None: no durable tier waited for)."""
    if ej.save_seq is None:
        return None
    step = ej.committed_step if ej.committed_step is not None else max(reached, 0)
    got = {t: left for t, s, left in ej.landed if s >= step}
    if durable:
        got["durable"] = None
    tiers = [t for t in TIERS if t in got]
    shown = ", ".join(t if got[t] is None else f"{t} ({got[t]:.1f}s before the deadline)" for t in tiers)
    reason = f"the emergency checkpoint of step {step} reached {shown or 'no tier'} before the node was lost"
    if durable is False:
        reason += "; not the durable tier"
    if outlives := next((what for t, what in OUTLIVES if t in tiers), None):
        reason += f"; it outlives {outlives}"
    return log(
        "emergency_tiers_reached",
        "info" if tiers else "error",
        attempt=attempt,
        step=step,
        source=ej.source,
        tiers=tiers,
        left_s={t: got[t] for t in tiers if got[t] is not None},
        reason=reason,
    )
