"""What crosses the boundary between the ranks and their node's supervisor, defined once: the environment, phases,
heartbeats, the control file, and an operator's rollback request.

Values and bytes only, stdlib only (docs/design/process-and-protocol.md, The protocol).
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftsup import memtier
from ftsup.dataskips import MAX_DATA_POSITION as MAX_DATA_POSITION
from ftsup.dataskips import MAX_DATA_SKIPS as MAX_DATA_SKIPS
from ftsup.dataskips import DataSkips as DataSkips
from ftsup.dataskips import check_data_skips as check_data_skips
from ftsup.dataskips import encode_data_skips as encode_data_skips
from ftsup.dataskips import parse_data_skips as parse_data_skips
from ftsup.guard import IGNORE_ENV as GUARD_IGNORE_ENV
from ftsup.guard import PARENT_ENV as GUARD_PARENT_ENV

# ---------------------------------------------------------------------- the environment

HEARTBEAT_SOCKET_ENV = "FTSUP_HEARTBEAT_SOCKET"
HEARTBEAT_INTERVAL_ENV = "FTSUP_HEARTBEAT_INTERVAL_S"
CONTROL_FILE_ENV = "FTSUP_CONTROL_FILE"
CHECKPOINT_DIR_ENV = "FTSUP_CHECKPOINT_DIR"
RESUME_STEP_ENV = "FTSUP_RESUME_STEP"  # the checkpoint chosen at the attempt's launch; empty: none
RESUME_BOUND_ENV = "FTSUP_RESUME_BOUND"  # after a rollback: ftsup's loaders take no checkpoint past it; empty: none
ATTEMPT_ENV = "FTSUP_ATTEMPT"  # this and the next two are the attempt's mark (`ftsup.procs.Mark`)
RUN_ID_ENV = "FTSUP_RUN_ID"
NODE_ID_ENV = "FTSUP_NODE_ID"
DATA_SKIPS_ENV = "FTSUP_DATA_SKIPS"  # A:B,C:D: ranges of global data positions no rank serves (`parse_data_skips`)
KEEP_OLDER_THAN_STEPS_ENV = "FTSUP_KEEP_OLDER_THAN_STEPS"  # the history a rollback needs, for the engine's retention
COLLECTIVE_TIMEOUT_ENV = "FTSUP_COLLECTIVE_TIMEOUT_S"  # auto-instrumentation: a timeout for collectives given none
DURABLE_TIER_ENV = "FTSUP_CHECKPOINT_DURABLE"  # the durable tier's location (s3://BUCKET/PREFIX or a path); empty: none
NODE_LOCAL_ENV = "FTSUP_CHECKPOINT_NODE_LOCAL"  # "1": each node keeps its own checkpoint dir (`ftsup.store.nodes`)
DURABLE_TIMEOUT_ENV = "FTSUP_CHECKPOINT_DURABLE_TIMEOUT_S"  # the longest a load reads one durable checkpoint (seconds)
FALLBACK_DIR_ENV = "FTSUP_CHECKPOINT_FALLBACK_DIR"  # where an emergency save goes when the checkpoint dir refuses it
MEMORY_TIER_ENV = "FTSUP_CHECKPOINT_MEMORY"  # KEEP:DIR, the node's memory tier (`ftsup.memtier`); empty: none
ENV_NAMES = (
    HEARTBEAT_SOCKET_ENV,
    HEARTBEAT_INTERVAL_ENV,
    CONTROL_FILE_ENV,
    CHECKPOINT_DIR_ENV,
    RESUME_STEP_ENV,
    RESUME_BOUND_ENV,
    ATTEMPT_ENV,
    RUN_ID_ENV,
    NODE_ID_ENV,
    DATA_SKIPS_ENV,
    KEEP_OLDER_THAN_STEPS_ENV,
    COLLECTIVE_TIMEOUT_ENV,
    DURABLE_TIER_ENV,
    GUARD_PARENT_ENV,
    GUARD_IGNORE_ENV,
    NODE_LOCAL_ENV,
    DURABLE_TIMEOUT_ENV,
    FALLBACK_DIR_ENV,
    MEMORY_TIER_ENV,
)
"""Every variable of ours a rank's environment holds."""

DEFAULT_INTERVAL_S = 0.5  # a rank's beat interval in `eval` when the supervisor exports none


def channel_env(
    *, heartbeat_socket: str, interval_s: float, control_file: str, checkpoint_dir: str, resume_step: int | None
) -> dict[str, str]:
    """The channel to this supervisor, as the ranks' environment carries it."""
    return {
        HEARTBEAT_SOCKET_ENV: heartbeat_socket,
        HEARTBEAT_INTERVAL_ENV: repr(interval_s),
        CONTROL_FILE_ENV: control_file,
        CHECKPOINT_DIR_ENV: checkpoint_dir,
        RESUME_STEP_ENV: "" if resume_step is None else str(resume_step),
    }


@dataclass(frozen=True)
class RuntimeEnv:
    """What a rank learns from its environment: the channel, the attempt, and torchrun's ranks."""

    heartbeat_socket: str | None = None
    heartbeat_interval_s: float = DEFAULT_INTERVAL_S
    control_file: str | None = None
    checkpoint_dir: str | None = None
    resume_step: int | None = None
    resume_bound: int | None = None  # RESUME_BOUND_ENV: a rollback's; a load takes no checkpoint past it
    durable_tier: str | None = None
    """DURABLE_TIER_ENV: where the durable tier is, for a resume from a checkpoint only it holds."""
    attempt: int = 0
    run_id: str | None = None
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    data_skips: DataSkips = ()  # DATA_SKIPS_ENV: the data positions this run's schedule never serves
    node_id: str | None = None
    """NODE_ID_ENV: the id of this rank's node."""
    node_local: bool = False
    """NODE_LOCAL_ENV: each node keeps its own checkpoint dir (its first local rank commits there)."""
    durable_timeout_s: float | None = None
    """DURABLE_TIMEOUT_ENV: the longest a load reads one durable checkpoint before the next (None: the tier's own)."""
    fallback_dir: str | None = None
    """FALLBACK_DIR_ENV: where an emergency save is written again when the checkpoint dir refuses it."""
    memory_tier: memtier.MemoryTier | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> RuntimeEnv:
        """Parse `env` (default: this process's); ValueError naming the variable when one is set
        but not a number (or, for DATA_SKIPS_ENV, not ranges of data positions)."""
        env = os.environ if env is None else env

        def num(key: str, default: int | None) -> int | None:
            raw = env.get(key, "").strip()
            if not raw:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None

        def seconds(key: str, default: float) -> float:
            raw = env.get(key, "").strip()
            if not raw:
                return default
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not (0 < value < math.inf):
                raise ValueError(f"environment variable {key}={raw!r} is not a positive number of seconds")
            return value

        return cls(
            heartbeat_socket=env.get(HEARTBEAT_SOCKET_ENV) or None,
            heartbeat_interval_s=seconds(HEARTBEAT_INTERVAL_ENV, DEFAULT_INTERVAL_S),
            control_file=env.get(CONTROL_FILE_ENV) or None,
            checkpoint_dir=env.get(CHECKPOINT_DIR_ENV) or None,
            resume_step=num(RESUME_STEP_ENV, None),
            resume_bound=num(RESUME_BOUND_ENV, None),
            durable_tier=env.get(DURABLE_TIER_ENV) or None,
            attempt=num(ATTEMPT_ENV, 0) or 0,
            run_id=env.get(RUN_ID_ENV) or None,
            rank=num("RANK", 0) or 0,
            local_rank=num("LOCAL_RANK", 0) or 0,
            world_size=num("WORLD_SIZE", 1) or 1,
            data_skips=parse_data_skips(env.get(DATA_SKIPS_ENV, ""), f"environment variable {DATA_SKIPS_ENV}"),
            node_id=env.get(NODE_ID_ENV) or None,
            node_local=env.get(NODE_LOCAL_ENV, "").strip() == "1",
            durable_timeout_s=seconds(DURABLE_TIMEOUT_ENV, 0.0) or None,
            fallback_dir=env.get(FALLBACK_DIR_ENV) or None,
            memory_tier=memtier.parse(env.get(MEMORY_TIER_ENV, ""), f"environment variable {MEMORY_TIER_ENV}"),
        )


# ---------------------------------------------------------------------- phases


class Phase(enum.StrEnum):
    """What a rank is doing, as its heartbeats say. In `save` and `load` a rank may stay silent up to the save timeout;
    in `eval` (work without optimizer steps) it beats from a thread, no step progress expected; `done`: teardown.
    A StrEnum: its str() and f-strings give the wire name."""

    INIT = "init"
    LOAD = "load"
    TRAIN = "train"
    EVAL = "eval"
    SAVE = "save"
    DONE = "done"


PHASE_NAMES = tuple(p.value for p in Phase)
SLOW_PHASES = frozenset({Phase.SAVE, Phase.LOAD})  # a rank may be silent up to save_timeout_s
KEEPALIVE_PHASES = frozenset({Phase.EVAL})  # the client beats from a thread, every heartbeat interval
LONG_PHASES = SLOW_PHASES | KEEPALIVE_PHASES  # no step progress expected, for up to save_timeout_s
QUIET_PHASES = frozenset({Phase.DONE})  # training finished, tearing down: torchrun's exit decides

# ---------------------------------------------------------------------- heartbeats

BEAT_VERSION = 2
BASE_FIELDS = ("v", "attempt", "rank", "local_rank", "pid", "step", "phase", "t", "mono")
MAX_BEAT_BYTES = 4096
MAX_FIGURES = 16
FIGURE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
MAX_STEP = 10**12
MAX_FIGURE_INT = 2**53  # larger integers travel as floats (JSON readers differ beyond this)

# A beat's steps the policy reads: one committed in the checkpoint dir; the save asked for committed there, or in the
# fallback dir, or failed in both; the vanished dir made again; one in memory, in the peers'; a stop another node asked.
COMMITTED_STEP, SAVED_STEP, FALLBACK_STEP = "committed_step", "saved_step", "fallback_step"
SAVE_FAILED_STEP, DIR_RECREATED_STEP = "save_failed_step", "dir_recreated_step"
MEMORY_STEP, PEERS_STEP, STOPPED_ELSEWHERE_STEP = "memory_step", "peers_step", "stopped_elsewhere_step"

_INT_LIMITS = {"attempt": 2**31 - 1, "rank": 2**24, "local_rank": 2**16, "pid": 2**22, "step": MAX_STEP}
_MAX_INT_DIGITS = 20  # no field or figure needs more; Python would otherwise parse 4300 digits
_MAX_KEYS = len(BASE_FIELDS) + MAX_FIGURES


@dataclass(frozen=True)
class Beat:
    attempt: int
    rank: int
    local_rank: int
    pid: int  # as claimed; the receiver checks it against the kernel's word for the sender
    step: int
    phase: Phase
    sent_unix: float
    sent_mono: float  # the sender's monotonic clock (the same clock on every process of a machine)
    figures: tuple[tuple[str, float], ...] = ()  # a figure that was not finite at the rank is NaN


DROP_REASONS = ("malformed", "version", "spoofed", "foreign", "refused", "forged", "ahead")
"""Why the supervisor drops a message: not a beat (the first two, `BadBeat`), or one it does not admit or believe."""


class BadBeat(ValueError):
    """A message that is not a beat; `reason` says why (one of `DROP_REASONS`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def figure_value(value: object) -> float | int | None:
    """A figure as it travels: an int or a float, None for a number that is not finite (a NaN
    loss). ValueError for anything else (bools, strings, tensors of more than one element)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        item = getattr(value, "item", None)  # numpy scalars and 0-d tensors
        try:
            value = item() if callable(item) else None
        except (TypeError, ValueError, RuntimeError):
            value = None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a figure must be a number")
    if isinstance(value, int):
        return value if -MAX_FIGURE_INT <= value <= MAX_FIGURE_INT else figure_value(float(value))
    return value if math.isfinite(value) else None


def encode_beat(
    *,
    attempt: int,
    rank: int,
    local_rank: int,
    pid: int,
    step: int,
    phase: Phase,
    t: float,
    mono: float,
    figures: Mapping[str, object] | None = None,
) -> bytes:
    """One heartbeat on the wire. Figures that cannot travel (a bad name, a value that is not a
    number, more than MAX_FIGURES) are left out; the beat itself always goes."""
    base = (BEAT_VERSION, attempt, rank, local_rank, pid, step, phase.value, t, mono)
    msg: dict[str, object] = dict(zip(BASE_FIELDS, base, strict=True))
    for name, raw in (figures or {}).items():
        if len(msg) - len(BASE_FIELDS) >= MAX_FIGURES:
            break
        if name in msg or not FIGURE_NAME.match(name):
            continue
        try:
            msg[name] = figure_value(raw)
        except (ValueError, OverflowError):
            continue
    return json.dumps(msg, allow_nan=False, separators=(",", ":")).encode()


def _strict_json(raw: bytes) -> Any:
    """JSON with bounded integers, no NaN or Infinity, no key twice and at most _MAX_KEYS keys an object."""
    return json.loads(
        raw.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constants, object_pairs_hook=_unique_keys
    )


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not a number here")


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError("an integer of more than 20 digits")
    return int(digits)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    if len(pairs) > _MAX_KEYS:
        raise ValueError(f"more than {_MAX_KEYS} keys")
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("a key given twice")
    return obj


def _int_field(m: dict[str, object], key: str, low: int = 0) -> int:
    value = m.get(key)
    if type(value) is not int or not low <= value <= _INT_LIMITS[key]:
        raise BadBeat("malformed", f"{key} must be an integer in [{low}, {_INT_LIMITS[key]}], not {value!r:.40}")
    return value


def _finite(value: object) -> float | None:
    """A JSON number as a finite float, else None (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def _time_field(m: dict[str, object], key: str) -> float:
    value = _finite(m.get(key))
    if value is None or value < 0:
        raise BadBeat("malformed", f"{key} must be a finite number >= 0, not {m.get(key)!r:.40}")
    return value


def parse_beat(raw: bytes) -> Beat:
    """Check one message against the schema and return the beat it holds (its pid as claimed);
    BadBeat otherwise. Nothing is parsed that is longer than MAX_BEAT_BYTES or nested."""
    if len(raw) > MAX_BEAT_BYTES:
        raise BadBeat("malformed", f"{len(raw)} bytes, more than {MAX_BEAT_BYTES}")
    # A beat is one flat object, and none of its strings (phase, figure names) holds a bracket:
    # anything else with a bracket is not a beat, whatever its depth.
    if raw.count(b"{") != 1 or raw.count(b"}") != 1 or b"[" in raw:
        raise BadBeat("malformed", "not one flat JSON object")
    try:
        m = _strict_json(raw)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise BadBeat("malformed", f"not JSON: {e}") from None
    if not isinstance(m, dict):
        raise BadBeat("malformed", "not a JSON object")
    v = m.get("v")
    if type(v) is not int:
        raise BadBeat("malformed", f"v must be an integer, not {v!r:.40}")
    if v != BEAT_VERSION:
        raise BadBeat("version", f"protocol version {v}, this supervisor speaks {BEAT_VERSION}")
    phase = m.get("phase")
    if not isinstance(phase, str) or phase not in PHASE_NAMES:
        raise BadBeat("malformed", f"phase must be one of {PHASE_NAMES}, not {phase!r:.40}")
    figures: list[tuple[str, float]] = []
    for name, value in m.items():
        if name in BASE_FIELDS:
            continue
        if not FIGURE_NAME.match(name):
            raise BadBeat("malformed", f"figure name {name!r:.80} is not an identifier of at most 64 characters")
        number = math.nan if value is None else _finite(value)
        if number is None:
            raise BadBeat("malformed", f"figure {name} must be a finite number or null, not {value!r:.40}")
        figures.append((name, number))
    if len(figures) > MAX_FIGURES:
        raise BadBeat("malformed", f"{len(figures)} figures, more than {MAX_FIGURES}")
    return Beat(
        attempt=_int_field(m, "attempt"),
        rank=_int_field(m, "rank"),
        local_rank=_int_field(m, "local_rank"),
        pid=_int_field(m, "pid", low=1),
        step=_int_field(m, "step"),
        phase=Phase(phase),
        sent_unix=_time_field(m, "t"),
        sent_mono=_time_field(m, "mono"),
        figures=tuple(sorted(figures)),
    )


# ---------------------------------------------------------------------- the control file

CONTROL_VERSION = 1
MAX_CONTROL_BYTES = 8192
MAX_REASON_CHARS = 1024  # a longer reason is cut when written (escaped, it still fits MAX_CONTROL_BYTES)
_MAX_SEQ = 2**63 - 1


@dataclass(frozen=True)
class Request:
    """The supervisor's newest request: save at the next step boundary (`seq` counts requests),
    and stop after it when `stop`. `seq == 0`: none yet."""

    seq: int
    stop: bool = False
    reason: str = ""
    deadline_unix: float | None = None

    @property
    def pending(self) -> bool:
        return self.seq > 0


NO_REQUEST = Request(0)


class ControlVersionError(ValueError):
    """A control file without a format version, or of another one: refused, never acted on."""


def encode_control(request: Request) -> bytes:
    body = {
        "v": CONTROL_VERSION,
        "seq": request.seq,
        "action": "save",
        "stop": request.stop,
        "reason": request.reason[:MAX_REASON_CHARS],
        "deadline_unix": request.deadline_unix,
    }
    return json.dumps(body, allow_nan=False).encode()


def parse_control(raw: bytes) -> Request:
    """The request a control file holds. ControlVersionError when its version is missing or not
    CONTROL_VERSION; ValueError for anything else that is not a request of this schema."""
    if len(raw) > MAX_CONTROL_BYTES:
        raise ValueError(f"{len(raw)} bytes, more than {MAX_CONTROL_BYTES}")
    try:
        m = json.loads(raw.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constants)
    except RecursionError:  # the decoder recurses once per level of nesting
        raise ValueError("nested too deep") from None
    if not isinstance(m, dict):
        raise ValueError("not a JSON object")
    if "v" not in m:
        raise ControlVersionError(f"no format version (field v); this trainer reads version {CONTROL_VERSION}")
    if type(m["v"]) is not int or m["v"] != CONTROL_VERSION:
        raise ControlVersionError(f"format version {m['v']!r:.40}; this trainer reads version {CONTROL_VERSION}")
    seq, stop, reason, deadline = m.get("seq"), m.get("stop", False), m.get("reason", ""), m.get("deadline_unix")
    if m.get("action") != "save":
        raise ValueError(f"action must be 'save', not {m.get('action')!r:.40}")
    if type(seq) is not int or not 0 <= seq <= _MAX_SEQ:
        raise ValueError(f"seq must be an integer >= 0, not {seq!r:.40}")
    if type(stop) is not bool:
        raise ValueError(f"stop must be true or false, not {stop!r:.40}")
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
        raise ValueError(f"reason must be a string of at most {MAX_REASON_CHARS} characters")
    if deadline is not None and (_finite(deadline) is None or deadline < 0):
        raise ValueError(f"deadline_unix must be a finite time or null, not {deadline!r:.40}")
    return Request(seq, stop, reason, None if deadline is None else float(deadline))


# ---------------------------------------------------------------------- rollback requests

ROLLBACK_VERSION = 1
MAX_ROLLBACK_BYTES = 16384
MAX_WHO_CHARS = 256
_ROLLBACK_KEYS = ("v", "id", "to_step", "skips", "who", "reason", "requested_unix")
_REQUEST_ID = re.compile(r"[0-9a-f]{8,64}\Z")


@dataclass(frozen=True)
class RollbackRequest:
    """Resume from the checkpoint of step `to_step` (or the newest consistent one before it), with `skips`
    added to the data skips in force; `id` tells one request from the next."""

    id: str
    to_step: int
    skips: DataSkips = ()
    who: str = ""
    reason: str = ""
    requested_unix: float = 0.0


def encode_rollback(r: RollbackRequest) -> bytes:
    body = {
        "v": ROLLBACK_VERSION,
        "id": r.id,
        "to_step": r.to_step,
        "skips": [list(x) for x in r.skips],
        "who": r.who[:MAX_WHO_CHARS],
        "reason": r.reason[:MAX_REASON_CHARS],
        "requested_unix": r.requested_unix,
    }
    return json.dumps(body, allow_nan=False).encode()


def parse_rollback(raw: bytes) -> RollbackRequest:
    """The request a rollback file holds; ValueError saying what is wrong otherwise (too large, not JSON, another
    version, a missing or unknown key, a value of the wrong type or out of range)."""
    if len(raw) > MAX_ROLLBACK_BYTES:
        raise ValueError(f"{len(raw)} bytes, more than {MAX_ROLLBACK_BYTES}")
    try:
        m = _strict_json(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(m, dict) or type(m.get("v")) is not int or m["v"] != ROLLBACK_VERSION:
        raise ValueError(f"not a rollback request of format version {ROLLBACK_VERSION} (field v)")
    if odd := sorted(set(m) ^ set(_ROLLBACK_KEYS)):
        raise ValueError(f"{'unknown' if odd[0] in m else 'no'} key {odd[0]!r:.40}")
    rid, step, when = m["id"], m["to_step"], _finite(m["requested_unix"])
    if not isinstance(rid, str) or not _REQUEST_ID.match(rid):
        raise ValueError(f"id must be 8 to 64 lowercase hex digits, not {rid!r:.40}")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ValueError(f"to_step must be an integer in [0, {MAX_STEP}], not {step!r:.40}")
    if when is None or when < 0:
        raise ValueError(f"requested_unix must be a finite time, not {m['requested_unix']!r:.40}")
    for key, limit in (("who", MAX_WHO_CHARS), ("reason", MAX_REASON_CHARS)):
        if not isinstance(m[key], str) or len(m[key]) > limit or not m[key].isprintable():
            raise ValueError(f"{key} must be a printable string of at most {limit} characters")
    return RollbackRequest(rid, step, check_data_skips(m["skips"], "skips"), m["who"], m["reason"], when)
