"""What goes into and comes out of the supervisor's policy (`machine.step`): settings, events, actions.

Values only: no I/O, no clock, no decisions (docs/design/policy.md, Events and actions).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ftsup.protocol import Phase
from ftsup.supervisor.config.anomaly import AnomalyConfig
from ftsup.supervisor.config.forensics import ForensicsConfig
from ftsup.supervisor.config.job import HeartbeatMode, JobConfig


class SupervisorPhase(enum.StrEnum):
    """Where the policy's state machine is (`State.phase`; one series each in `ftsup_phase`)."""

    INIT = "init"
    PREPARING = "preparing"
    RUNNING = "running"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    DONE = "done"


# ---------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """What the policy needs from the config (seconds throughout). Built by `settings_from`: the defaults
    are the config's, declared once there; only the two margins below are the policy's own."""

    nproc_max: int  # local slots at most
    min_world_size: int
    max_world_size: int | None
    nnodes_max: int
    standby: bool  # a hot spare (`launch.standby`): its waits in the rendezvous are no failures (`policy.standby`)
    heartbeat_mode: HeartbeatMode
    heartbeat_timeout_s: float | None  # None: learned
    progress_timeout_s: float | None  # None: learned
    startup_timeout_s: float
    save_timeout_s: float
    min_timeout_s: float
    step_time_multiplier: float
    max_restarts: int
    window_s: float
    backoff_initial_s: float
    backoff_max_s: float
    max_attempts_without_progress: int
    save_margin_s: float  # safety margin when deciding whether an emergency save fits
    anomaly: AnomalyConfig  # the training-health detectors, rollback and escalation (`policy.anomaly`)
    forensics: ForensicsConfig  # the evidence captured before a hung attempt is stopped (`policy.evidence`)
    stop_margin_s: float = 1.0  # ranks still running this long before an eviction deadline are stopped
    assumed_save_bytes_per_s: float = 256 * 2**20  # until a save has been measured


# ---------------------------------------------------------------------- events


@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class LaunchReady:
    """Inputs for a launch, gathered by the daemon: healthy local slots (None: the health probe
    was blind), the checkpoint to resume from (None: fresh start), and the number the world size
    must divide (or None)."""

    healthy_slots: int | None
    resume_step: int | None
    batch_divisor: int | None = None
    at_most: int | None = None  # the bound on the resume step it was prepared with (`PrepareLaunch.at_most`)
    resume_samples: int | None = None  # the data position of the checkpoint resumed from, as its metadata says
    resume_final: bool = False  # the checkpoint resumed from is the job's final one: the job has finished


@dataclass(frozen=True)
class WorkersStarted:
    attempt: int
    pids: tuple[int, ...] = ()
    log: str | None = None  # the attempt's log file (torchrun's and the ranks' output)


@dataclass(frozen=True)
class WorkersRestarted:
    """torchrun replaced its rank processes itself (a node joined or left the rendezvous): the
    new ranks start from scratch, so they get the startup timeout again. Sent also (with
    `new_ranks=False`) when the ranks are gone and torchrun has not exited yet."""

    attempt: int
    new_ranks: bool = True


@dataclass(frozen=True)
class RanksStarted:
    """torchrun started its first worker group of the attempt: its rendezvous is over (on several nodes it may
    have waited there, as a hot spare does, for a long time)."""

    attempt: int


@dataclass(frozen=True)
class Heartbeat:
    """A beat of one of this node's ranks, fed at the time it was read off the channel.

    `sent` is the rank's own clock when it sent the beat (any clock that does not jump; the
    daemon passes the rank's monotonic clock): step times are measured on it, so that beats
    read late (the supervisor was busy) do not look like slow steps. None: the time it was read."""

    attempt: int
    local_rank: int  # ranks are tracked per node: this supervisor sees its own
    step: int
    phase: Phase
    rank: int = -1  # global rank, for logs
    figures: tuple[tuple[str, float], ...] = ()  # save_s, saved_step (`ftsup.protocol`'s save figures), loss, ...
    sent: float | None = None

    def figure(self, name: str) -> float | None:
        return dict(self.figures).get(name)


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended, as torchrun reported it (`root`: its first observed failure) or as the daemon saw it,
    with the last lines of that rank's own output (bounded; `ranklogs`). None: not known."""

    rank: int | None  # global rank
    local_rank: int | None = None
    pid: int | None = None
    exitcode: int | None = None  # negative: killed by that signal
    output: tuple[str, ...] = ()
    root: bool = False


@dataclass(frozen=True)
class RankExited:
    """A rank process ended while the attempt runs, and torchrun had not reported it in time."""

    attempt: int
    pid: int
    exitcode: int | None
    signal: int | None = None
    failure: RankFailure | None = None  # which rank it was, and its last lines


@dataclass(frozen=True)
class WorkersExited:
    """torchrun (and so the attempt) is gone, with its exit code (negative: signal), the ranks whose failure it
    reported, and the last lines of its own output (for a failure that names no rank)."""

    attempt: int
    exitcode: int
    failures: tuple[RankFailure, ...] = ()
    output: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tick:
    """The clock moved on; with what the daemon read of the ranks' processes (`states`: by local rank, the letter
    of /proc/PID/stat, or `hangs.GONE`), which tells a rank that stopped from one that waits for it."""

    states: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class OperatorStop:
    reason: str = "operator"


@dataclass(frozen=True)
class RollbackRequested:
    """An operator's rollback request (`ftsup rollback`, `ftsup.protocol.RollbackRequest`), read from the state
    directory: resume from a checkpoint of a step at most `to_step`, with `skips` added to the data skips."""

    id: str
    to_step: int
    skips: tuple[tuple[int, int], ...] = ()
    who: str = ""
    reason: str = ""


@dataclass(frozen=True)
class EvictionNoticed:
    """An eviction is coming (signal, cloud metadata, file, command), due at `deadline` (the
    daemon's clock). `advisory` (AWS rebalance): save now, keep training."""

    source: str
    deadline: float
    detail: str = ""
    advisory: bool = False
    state_bytes: int | None = None  # size of the last checkpoint, to estimate a save before one is timed
    upload_s: float | None = None  # with a durable tier: how long the checkpoint's upload to it is expected to take


@dataclass(frozen=True)
class CaptureRequested:
    """An operator asked for the ranks' evidence now (`ftsup incidents capture`); nothing is stopped."""

    id: str
    who: str = ""
    reason: str = ""


@dataclass(frozen=True)
class EvidenceCaptured:
    """The capture a `CaptureEvidence` asked for is over (complete, cut short at its bound, or failed)."""

    attempt: int


Event = (
    Start
    | LaunchReady
    | WorkersStarted
    | WorkersRestarted
    | RanksStarted
    | Heartbeat
    | RankExited
    | WorkersExited
    | Tick
    | OperatorStop
    | EvictionNoticed
    | RollbackRequested
    | CaptureRequested
    | EvidenceCaptured
)


# ---------------------------------------------------------------------- actions


@dataclass(frozen=True)
class PrepareLaunch:
    """Probe slot health, pick the latest consistent checkpoint (of a step at most `at_most`, setting aside the
    committed ones after it: a rollback), then send LaunchReady."""

    attempt: int
    at_most: int | None = None


@dataclass(frozen=True)
class Launch:
    attempt: int
    nproc: int  # local ranks for this attempt
    resume_step: int | None
    skips: tuple[tuple[int, int], ...] = ()  # the data skips in force (FTSUP_DATA_SKIPS)
    resume_bound: int | None = None  # a rollback's (FTSUP_RESUME_BOUND): no other launch bounds the ranks' load


@dataclass(frozen=True)
class StopWorkers:
    attempt: int
    reason: str
    grace_s: float | None = None  # SIGTERM -> SIGKILL grace; None: the configured one


@dataclass(frozen=True)
class RequestSave:
    """Ask the ranks (control file) to save at the next step boundary, and maybe stop after."""

    seq: int
    stop: bool
    reason: str
    deadline: float | None


@dataclass(frozen=True)
class AckEviction:
    """Tell the notice's source that we are ready (Azure: StartRequests)."""

    source: str


@dataclass(frozen=True)
class Exit:
    code: int
    reason: str


@dataclass(frozen=True)
class Log:
    event: str
    level: str = "info"
    fields: tuple[tuple[str, object], ...] = ()

    def as_dict(self) -> dict[str, object]:
        return dict(self.fields)


def log(event: str, level: str = "info", **fields: object) -> Log:
    return Log(event, level, tuple(sorted(fields.items())))


@dataclass(frozen=True)
class CheckpointCommitted:
    """The ranks reported a checkpoint committed that no store scan has seen yet (an eviction's emergency save):
    the durable tier may take it now."""

    step: int
    kind: str
    fallback: bool = False  # in the fallback directory (`checkpoint.durable.fallback_dir`): the store refused it


@dataclass(frozen=True)
class WriteJournal:
    """Write the journal now: what `ftsup status` reads from it changed (a straggler found or gone)."""


@dataclass(frozen=True)
class CaptureEvidence:
    """Capture every rank's evidence (stacks, process state, last beats and lines, NCCL's flight recorder) within
    `timeout_s` and keep it as an incident record; then `EvidenceCaptured`, before the actions after it (a stop)."""

    attempt: int
    trigger: str  # what asked for it: hang, straggler, operator
    event: str  # the event that said why: heartbeat_timed_out, straggler_detected, capture_requested, ...
    reason: str
    timeout_s: float
    rank: int | None = None  # the rank the policy blames (global), or the straggler; None: none named
    local_rank: int | None = None
    state: str | None = None  # the blamed rank's process state, as the tick read it
    waiting: tuple[int, ...] = ()  # the ranks taken to wait for it
    step: int | None = None


Action = (
    PrepareLaunch
    | Launch
    | StopWorkers
    | RequestSave
    | AckEviction
    | Exit
    | Log
    | CheckpointCommitted
    | WriteJournal
    | CaptureEvidence
)


def settings_from(cfg: JobConfig, nproc_max: int) -> Settings:
    """The policy's settings: this config, with `launch.nproc_per_node` resolved to `nproc_max`."""
    hb, rs, ln = cfg.heartbeat, cfg.restart, cfg.launch
    return Settings(
        nproc_max=nproc_max,
        min_world_size=ln.min_world_size,
        max_world_size=ln.max_world_size,
        nnodes_max=ln.max_nodes,
        standby=ln.standby,
        heartbeat_mode=hb.mode,
        heartbeat_timeout_s=hb.timeout_s,
        progress_timeout_s=hb.progress_timeout_s,
        startup_timeout_s=hb.startup_timeout_s,
        save_timeout_s=hb.save_timeout_s,
        min_timeout_s=hb.min_timeout_s,
        step_time_multiplier=hb.step_time_multiplier,
        max_restarts=rs.max_restarts,
        window_s=rs.window_s,
        backoff_initial_s=rs.backoff_initial_s,
        backoff_max_s=rs.backoff_max_s,
        max_attempts_without_progress=rs.max_attempts_without_progress,
        save_margin_s=cfg.eviction.save_margin_s,
        anomaly=cfg.anomaly,
        forensics=cfg.forensics,
    )
