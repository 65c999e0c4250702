"""A hot spare's attempts (`launch.standby`): its wait in torchrun's rendezvous is no failure, a wait that ends before
its ranks started is a release to the next round, and a job that has finished is left. Pure; `machine.step` asks
`step` first (docs/design/policy.md, Hot spares).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from ftsup.supervisor.policy import failures
from ftsup.supervisor.policy.events import (
    Action,
    Event,
    Exit,
    LaunchReady,
    RanksStarted,
    Settings,
    SupervisorPhase,
    WorkersExited,
    log,
)
from ftsup.supervisor.policy.rules import backoff_s

if TYPE_CHECKING:
    from ftsup.supervisor.policy.machine import Attempt, State


def step(s: Settings, st: State, ev: Event, now: float, ok: int) -> tuple[State, list[Action]] | None:
    """What a hot spare's events change, before the rest of the machine sees them (None: nothing here; `ok` is the
    exit status of a job that finished):

    - the attempt's ranks started (`RanksStarted`): its wait is over; a spare has joined the job (`standby_joined`);
    - torchrun ended before the spare's ranks started: the round it waited on is over (a node was lost, or the job
      ended and closed it). `standby_released`, and a relaunch into the next round, at once after a long wait,
      else with the backoff of the releases in a row; no restart, failure or progress is counted;
    - a launch would resume from the job's final checkpoint: the job finished without the spare (`ok`)."""
    att = st.attempt
    if isinstance(ev, RanksStarted) and att is not None and ev.attempt == att.number:
        joined: list[Action] = [
            log("standby_joined", attempt=att.number, world_size=att.nproc, duration_s=round(now - att.launched_at, 3))
        ]
        return replace(st, attempt=replace(att, ranks_at=now), standby_releases=0), joined if s.standby else []
    if not s.standby:
        return None
    if isinstance(ev, LaunchReady) and st.phase == SupervisorPhase.PREPARING and ev.resume_final:
        why = (
            f"the job finished without this standby: the newest checkpoint, of step {ev.resume_step}, is its final one"
        )
        return replace(st, phase=SupervisorPhase.DONE, attempt=None, final=Exit(ok, why)), [
            log("job_succeeded", attempt=st.attempt_no, step=ev.resume_step, reason=why),
            Exit(ok, why),
        ]
    if (
        isinstance(ev, WorkersExited)
        and att is not None
        and ev.attempt == att.number
        and att.ranks_at is None
        and st.phase == SupervisorPhase.RUNNING
        and st.final is None
        and st.anomaly.pending is None
        and ev.exitcode != 0
    ):
        releases = st.standby_releases + 1
        waited = now - att.launched_at
        wait = 0.0 if waited >= s.backoff_max_s else backoff_s(s, releases)
        why = f"its rendezvous round is over ({failures.exited_reason(ev)})"
        return replace(
            st,
            phase=SupervisorPhase.BACKOFF,
            attempt=None,
            stop_reason=None,
            resume_at=now + wait,
            standby_releases=releases,
        ), [log("standby_released", attempt=att.number, reason=why, duration_s=round(waited, 3), retry_in_s=wait)]
    return None


def startup_from(s: Settings, att: Attempt) -> float:
    """When the startup timeout of `att` starts: its launch on one node; on several, when torchrun started its ranks
    (a rendezvous may wait for the other nodes, or hold a spare, for as long as torchrun lets it: torchrun's join
    timeout bounds a round that cannot form), infinitely late before that."""
    if s.nnodes_max == 1:
        return att.launched_at
    return math.inf if att.ranks_at is None else max(att.launched_at, att.ranks_at)


def bound(s: Settings, ev: LaunchReady) -> int | None:
    """The resume step the ranks are given (`FTSUP_RESUME_STEP`): a spare may join a round long after its launch,
    when newer checkpoints exist, so it is given none unless a rollback bounds it."""
    return None if s.standby and ev.at_most is None else ev.resume_step
