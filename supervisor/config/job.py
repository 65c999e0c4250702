"""The job config: a YAML file turned into frozen dataclasses, or one `ConfigError` line saying what to fix.

`load_config(path)` reads a file, `parse_config(mapping, ...)` checks a loaded one; both return a `JobConfig`, one
section per YAML section (`deploy/examples/job.yaml` shows every key). Its rules: docs/design/config.md.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftsup.supervisor import statedir
from ftsup.supervisor.config import file as config_file
from ftsup.supervisor.config import signals as config_signals
from ftsup.supervisor.config import values as config_values
from ftsup.supervisor.config.anomaly import AnomalyConfig, parse_anomaly
from ftsup.supervisor.config.durable import DurableConfig, parse_durable
from ftsup.supervisor.config.forensics import ForensicsConfig, parse_forensics
from ftsup.supervisor.config.launch import LaunchConfig, parse_launch
from ftsup.supervisor.config.memory import MemoryConfig, parse_memory
from ftsup.supervisor.config.values import Section, Where
from ftsup.supervisor.errors import ConfigError
from ftsup.workdir import default_checkpoint_dir

SECTIONS = (
    "job",
    "launch",
    "checkpoint",
    "heartbeat",
    "restart",
    "eviction",
    "metrics",
    "logging",
    "anomaly",
    "forensics",
)
PROVIDERS = config_values.PROVIDERS  # eviction.providers, checked in `config.values`
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")

_EXAMPLE = "deploy/examples/job.yaml"
_SHARED_STORE = "nnodes ({}) allows more than one node, so set it to a directory every node shares"
_NODE_LOCAL = (
    "is false and nnodes ({}) allows more than one node: each node's part of a checkpoint is committed in a durable "
    "tier on object storage, the only place every node reads, so set checkpoint.durable to s3://BUCKET/PREFIX (or "
    "make checkpoint.dir a directory every node shares and dir_shared true, or keep every node's part in a peer's "
    "memory too: checkpoint.memory with replicas of 1 or more)"
)


# --------------------------------------------------------------------------- the sections


@dataclass(frozen=True)
class JobSection:
    """`job:` what every rank runs, where, and under which id."""

    command: tuple[str, ...]
    """The training command as an argv list, run without a shell:
    `[python, -m, ftsup.trainer.examples.gpt, --steps, "200"]`. Numbers must be quoted so that each argument is passed
    exactly as written. A bare `python`/`python3` is the interpreter ftsup runs under, not the first on PATH (give a
    path for another); the interpreter that runs torchrun must find torch, or the config is refused."""
    workdir: Path
    """Working directory of the ranks. Default: the config file's directory; relative paths resolve against it."""
    run_id: str
    """Id of this job: names the journal, the default `launch.rdzv_id` and `FTSUP_RUN_ID`. Default: "ftsup-" + the
    first 8 hex digits of sha256 of the config file's absolute path. That default differs between nodes whose config
    files live at different paths, so multi-node jobs should set it (or `launch.rdzv_id`)."""
    state_dir: Path
    """This node's journal, lock and logs (`default_state_dir`): under systemd the unit's StateDirectory,
    else `<workdir>/.ftsup/<launch.node_id>` (a `.ftsup` that ftsup creates holds a `.gitignore` of `*`)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables added for the ranks, on top of the supervisor's own. Values are strings (quote numbers)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """`checkpoint:` where the ranks' checkpoints live (the checkpoint store, `ftsup/store/DESIGN.md`)."""

    dir: Path
    """The checkpoint store, shared by every node of a multi-node job, which must set it. Default (one node):
    `<job.workdir>/.ftsup/checkpoints`. Relative paths resolve against the config file's directory."""
    verify_deep: bool = False
    """Check every checksum of the chosen checkpoint before each relaunch (slower; the fast check reads sizes only)."""
    durable: DurableConfig | None = None
    """A durable tier (`s3://BUCKET/PREFIX` or a shared filesystem path, or a mapping: `config.durable`) that the
    supervisor copies committed checkpoints to, off the training path. Null: none, and nothing changes."""
    dir_shared: bool = True
    """Whether every node sees the same `dir`. False: each node keeps its own (node-local disk); each node's
    supervisor uploads its node's part of a checkpoint and one commits it once every node's part is there, and a
    job resumes from the newest checkpoint of the durable tier. A multi-node job needs an s3:// `durable` for it."""
    memory: MemoryConfig | None = None
    """The node's memory tier (true, a tmpfs directory, or a mapping: `config.memory`): every save also lands there,
    and a load reads it first when it holds the newest checkpoint. Null or false: none."""


COLLECTIVE_MARGIN_S = 60.0
"""How much longer than `heartbeat.save_timeout_s` a collective may wait by default (`collective_timeout_s` null)."""


class HeartbeatMode(enum.StrEnum):
    """Which detections apply (`heartbeat.mode`; `policy.rules.hang_detection_on`): crashes always; hangs, stalls
    and a slow start from launch on (`required`), once the job's first heartbeat arrived (`auto`) or never (`off`)."""

    OFF = "off"
    AUTO = "auto"
    REQUIRED = "required"


@dataclass(frozen=True)
class HeartbeatConfig:
    """`heartbeat:` when a silent or stuck rank counts as hung. Null timeouts are learned from observed step times."""

    mode: HeartbeatMode = HeartbeatMode.AUTO
    """Which detections apply. Crashes (a rank's or torchrun's exit) always do. "required": hangs, stalls and a slow
    start too, from launch on (a rank with no first training step within startup_timeout_s has failed). "auto":
    the same once the job's first heartbeat arrives (an instrumented rank's first optimizer step), crashes only
    before, so that a script that sends none is never killed for it. "off": crashes only."""
    timeout_s: float | None = None
    """No heartbeat at all from a rank for this long = hung. Null: learned (step_time_multiplier x p99 step time,
    at least min_timeout_s)."""
    progress_timeout_s: float | None = None
    """Heartbeats but no step progress for this long = stuck. Null: learned like `timeout_s`."""
    startup_timeout_s: float = 300.0
    """From launch to the first training-step heartbeat (imports, rendezvous, checkpoint load)."""
    save_timeout_s: float = 900.0
    """How long a rank may stay in phase save, load or eval before it counts as hung."""
    min_timeout_s: float = 2.0
    """Floor of the learned timeouts, so that a run of fast steps does not make them hair-trigger."""
    step_time_multiplier: float = 3.0
    """Learned timeout = this x the p99 step time (at least 1)."""
    interval_s: float = 0.5
    """How often a rank in phase eval beats (the runtime client does it from a thread, see `rt.phase("eval")`);
    exported to the ranks as FTSUP_HEARTBEAT_INTERVAL_S. Every timeout must be longer."""
    collective_timeout_s: float | None = None
    """The timeout of a collective under auto-instrumentation, for a script whose `init_process_group` or `new_group`
    gives none: a rank that waits longer for its peers fails with torch's error, naming the collective. Null:
    save_timeout_s + 60. Longer than save_timeout_s: one rank may save, load or evaluate that long while its peers
    wait in their next collective."""

    @property
    def collective_timeout(self) -> float:
        """`collective_timeout_s`, or its default when null (COLLECTIVE_MARGIN_S past `save_timeout_s`)."""
        return (
            self.collective_timeout_s
            if self.collective_timeout_s is not None
            else (self.save_timeout_s + COLLECTIVE_MARGIN_S)
        )


@dataclass(frozen=True)
class RestartConfig:
    """`restart:` the restart budget, backoff and crash-loop breaker."""

    max_restarts: int = 10
    """Restarts allowed within `window_s`; one more and the job stops (failure)."""
    window_s: float = 3600.0
    """The sliding window over which `max_restarts` is counted."""
    backoff_initial_s: float = 1.0
    """Wait before a restart after an attempt that reached no new step; doubles after each further one. A
    failure after progress restarts at once."""
    backoff_max_s: float = 60.0
    """Ceiling of the backoff (at least `backoff_initial_s`)."""
    max_attempts_without_progress: int = 3
    """Attempts in a row that complete no new step before the crash-loop breaker stops the job."""
    stop_grace_s: float = 10.0
    """From SIGTERM to SIGKILL of the rank process tree."""


@dataclass(frozen=True)
class EvictionConfig:
    """`eviction:` where eviction notices come from and how much time a save needs."""

    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """Signals to the supervisor that mean "evicted": canonical names ("USR1" and "usr1" are stored as "SIGUSR1")."""
    providers: tuple[str, ...] = ()
    """Cloud metadata watchers: any of "aws", "gcp", "azure", or ("auto",) to detect the cloud; () = none."""
    endpoint: str | None = None
    """Base URL replacing every provider's metadata address (tests point it at 127.0.0.1); no trailing slash."""
    poll_interval_s: float = 1.0
    """How often metadata endpoints are polled (GCP long-polls instead)."""
    default_deadline_s: float = 30.0
    """Deadline of a notice that carries none (signals, files, commands)."""
    save_margin_s: float = 5.0
    """Safety margin: a save is started only if its expected duration plus this margin fits before the deadline."""
    file: Path | None = None
    """A file whose appearance is an eviction notice; relative paths resolve against the config file's directory."""
    command: tuple[str, ...] | None = None
    """An argv polled every `poll_interval_s`; output on stdout is an eviction notice."""
    requeue_command: tuple[str, ...] | None = None
    """Run after an emergency save to requeue the job. Null: under Slurm `scontrol requeue $SLURM_JOB_ID`, else none."""


@dataclass(frozen=True)
class MetricsConfig:
    """`metrics:` the Prometheus endpoint."""

    listen: str | None = None
    """"host:port" to serve /metrics on (port 0 = any free port); null = no endpoint. See `split_host_port`."""


@dataclass(frozen=True)
class LoggingConfig:
    """`logging:` the supervisor's own log lines, and the ranks' output on its stdout (per-attempt files regardless)."""

    dir: Path | None = None
    """Directory for log files; null lets the daemon choose (under `job.state_dir`)."""
    level: str = "info"
    """One of debug, info, warning, error."""
    format: str = "json"
    """stderr: "json" (DESIGN.md, Contracts), but a short line per change of state on a terminal; "console": those
    lines wherever stderr goes. The log file is JSON either way."""
    echo: bool = True
    """Copy the ranks' output to stdout as it comes, as torchrun's `--tee` shows it (torchrun's lines, and each rank's
    prefixed `[rankN]: `); the attempt's log file holds the same lines either way. False: stdout stays quiet, for a
    journal that should hold only the supervisor's lines."""


@dataclass(frozen=True)
class JobConfig:
    """A whole validated job config."""

    job: JobSection
    """What runs, where, under which id."""
    launch: LaunchConfig
    """torchrun, world sizes, rendezvous."""
    checkpoint: CheckpointConfig
    """The checkpoint store."""
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    """Hang and stall detection."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """Restart budget and backoff."""
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    """Eviction notices."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Prometheus endpoint."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Supervisor logs."""
    anomaly: AnomalyConfig = field(default_factory=AnomalyConfig)
    """Training-health detectors, rollback, escalation."""
    forensics: ForensicsConfig = field(default_factory=ForensicsConfig)
    """The evidence captured before a hung attempt is stopped, and the incident records kept."""
    source: str = "<string>"
    """Where the config came from (the path as given), for messages."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (paths as strings, tuples as lists) for `ftsup status --json` and the journal."""
        return config_values.plain_dataclass(self)


def split_host_port(value: str) -> tuple[str, int]:
    """("host", port) of a validated "host:port" string; brackets of an IPv6 host such as "[::1]:9400" removed."""
    host, _, port = value.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


# --------------------------------------------------------------------------- entry points


def load_config(path: str | os.PathLike[str], *, hostname: str | None = None) -> JobConfig:
    """Read and validate the YAML job config at `path`. Raises `ConfigError` (one line) for anything wrong.

    `hostname` is the default `launch.node_id` (None: `socket.gethostname()`).
    """
    absolute = Path(os.path.abspath(path))
    raw = read_document(path)
    return parse_config(raw, source=os.fspath(path), base_dir=absolute.parent, config_path=absolute, hostname=hostname)


def read_document(path: str | os.PathLike[str]) -> object:
    """The YAML document of the config file at `path`, not yet validated (`parse_config` does that)."""
    source = os.fspath(path)
    raw = config_file.load_yaml(config_file.read_text(source, Path(os.path.abspath(source)), example=_EXAMPLE), source)
    if raw is None:
        raise ConfigError(
            f"{source}: the file is empty (or only comments); a job config needs at least job.command "
            f"(example: {_EXAMPLE})"
        )
    return raw


def parse_config(
    mapping: object,
    *,
    source: str = "<string>",
    base_dir: Path | None = None,
    config_path: Path | None = None,
    hostname: str | None = None,
    origins: Mapping[str, str] | None = None,
) -> JobConfig:
    """Validate an already-loaded mapping (the YAML document) into a `JobConfig`.

    `source` prefixes every error message, or `origins[section.key]` (a command-line flag) for an error in the
    value of that key. `base_dir` is what relative paths resolve against (None: the current directory).
    `config_path` is hashed into the default `job.run_id` (None: `base_dir` is). `hostname` is the default
    `launch.node_id` (None: `socket.gethostname()`, asked only when needed).
    """
    base = Path(os.path.abspath(base_dir if base_dir is not None else os.curdir))
    top = Where(source, origins=origins or {})
    if not isinstance(mapping, Mapping):
        top.fail(
            f"expected a mapping of sections ({', '.join(SECTIONS)}) at the top level, "
            f"got {config_values.describe(mapping)}"
        )
    config_values.check_keys(top, mapping, SECTIONS, noun="section")
    # Every section's keys are checked before any value, so a misspelt key is reported before what it causes.
    job = Section(top.child("job"), mapping.get("job"), JobSection)
    launch = Section(top.child("launch"), mapping.get("launch"), LaunchConfig)
    checkpoint = Section(top.child("checkpoint"), mapping.get("checkpoint"), CheckpointConfig)
    heartbeat = Section(top.child("heartbeat"), mapping.get("heartbeat"), HeartbeatConfig)
    restart = Section(top.child("restart"), mapping.get("restart"), RestartConfig)
    eviction = Section(top.child("eviction"), mapping.get("eviction"), EvictionConfig)
    metrics = Section(top.child("metrics"), mapping.get("metrics"), MetricsConfig)
    logging = Section(top.child("logging"), mapping.get("logging"), LoggingConfig)
    anomaly = Section(top.child("anomaly"), mapping.get("anomaly"), AnomalyConfig)
    forensics = Section(top.child("forensics"), mapping.get("forensics"), ForensicsConfig)

    digest = hashlib.sha256(str(config_path if config_path is not None else base).encode()).hexdigest()
    run_id = job.optional("run_id", config_values.identifier, f"ftsup-{digest[:8]}")
    launch_config = parse_launch(launch, run_id=run_id, hostname=hostname)
    job_section = _parse_job(job, base, run_id=run_id, node_id=launch_config.node_id, config_path=config_path)
    dir_shared = checkpoint.optional("dir_shared", config_values.boolean)
    durable = checkpoint.nullable("durable", parse_durable)
    if launch_config.max_nodes > 1 and dir_shared:  # a default under a node's own workdir would split the store
        ckpt_dir = checkpoint.required("dir", config_values.path(base), _SHARED_STORE.format(launch_config.nnodes))
    else:  # beside the state directory, in a .ftsup that git ignores
        ckpt_dir = checkpoint.optional("dir", config_values.path(base), default_checkpoint_dir(job_section.workdir))
    memory = checkpoint.nullable("memory", parse_memory)
    peers = memory is not None and memory.replicas > 0  # every node's part is also in another node's memory
    if launch_config.max_nodes > 1 and not dir_shared and (durable is None or not durable.is_s3) and not peers:
        checkpoint.fail("dir_shared", _NODE_LOCAL.format(launch_config.nnodes))
    fallback = Path(durable.fallback_dir) if durable is not None and durable.fallback_dir is not None else None
    if fallback is not None and (fallback == ckpt_dir or ckpt_dir in fallback.parents or fallback in ckpt_dir.parents):
        top.child("checkpoint").child("durable").child("fallback_dir").fail(
            f"{fallback} overlaps checkpoint.dir ({ckpt_dir}), the directory it stands in for; give one apart from it, "
            "on another filesystem"
        )
    return JobConfig(
        job=job_section,
        launch=launch_config,
        checkpoint=CheckpointConfig(
            dir=ckpt_dir,
            verify_deep=checkpoint.optional("verify_deep", config_values.boolean),
            durable=durable,
            dir_shared=dir_shared,
            memory=memory,
        ),
        heartbeat=_parse_heartbeat(heartbeat),
        restart=_parse_restart(restart),
        eviction=_parse_eviction(eviction, base),
        metrics=MetricsConfig(
            listen=metrics.nullable("listen", config_values.host_port(min_port=0, example="0.0.0.0:9400"))
        ),
        logging=LoggingConfig(
            dir=logging.nullable("dir", config_values.path(base)),
            level=logging.optional("level", config_values.choice(LOG_LEVELS)),
            format=logging.optional("format", config_values.choice(LOG_FORMATS)),
            echo=logging.optional("echo", config_values.boolean),
        ),
        anomaly=parse_anomaly(anomaly),
        forensics=parse_forensics(forensics),
        source=source,
    )


# --------------------------------------------------------------------------- section parsers


def _parse_job(sec: Section, base: Path, *, run_id: str, node_id: str, config_path: Path | None) -> JobSection:
    workdir = sec.optional("workdir", config_values.path(base), base)
    state_dir = statedir.default_state_dir(workdir, node_id, config_path, os.environ)
    return JobSection(
        command=sec.required(
            "command", config_values.argv, "give the training command as a list, e.g. [python, train.py]"
        ),
        workdir=workdir,
        run_id=run_id,
        state_dir=sec.optional("state_dir", config_values.path(base), state_dir),
        env=sec.optional("env", config_values.env),
    )


_DERIVED_COLLECTIVE = "; leave it out (or null) for heartbeat.save_timeout_s + 60"


def _parse_heartbeat(sec: Section) -> HeartbeatConfig:
    learned = "; leave it out (or null) to learn it from observed step times"
    config = HeartbeatConfig(
        mode=HeartbeatMode(sec.optional("mode", config_values.choice(tuple(m.value for m in HeartbeatMode)))),
        timeout_s=sec.nullable("timeout_s", config_values.seconds(fix=learned)),
        progress_timeout_s=sec.nullable("progress_timeout_s", config_values.seconds(fix=learned)),
        startup_timeout_s=sec.optional("startup_timeout_s", config_values.seconds()),
        save_timeout_s=sec.optional("save_timeout_s", config_values.seconds()),
        min_timeout_s=sec.optional("min_timeout_s", config_values.seconds()),
        step_time_multiplier=sec.optional(
            "step_time_multiplier", config_values.number(low=1.0, low_ok=True, high=1000.0, unit="")
        ),
        interval_s=sec.optional("interval_s", config_values.seconds()),
        collective_timeout_s=sec.nullable("collective_timeout_s", config_values.seconds(fix=_DERIVED_COLLECTIVE)),
    )
    if config.collective_timeout_s is not None and config.collective_timeout_s <= config.save_timeout_s:
        sec.fail(
            "collective_timeout_s",
            f"{config.collective_timeout_s:g} is not above heartbeat.save_timeout_s {config.save_timeout_s:g}; a "
            "rank's peers wait in a collective while it saves, loads or evaluates that long, so raise it (or leave "
            "it out: save_timeout_s + 60)",
        )
    # A timeout no longer than the beat interval would call every idle rank hung.
    for key in ("timeout_s", "min_timeout_s"):
        value = getattr(config, key)
        if value is not None and value <= config.interval_s:
            sec.fail(
                key,
                f"{value:g} is not above heartbeat.interval_s {config.interval_s:g}; ranks beat only every "
                f"interval_s, so raise {key} or lower interval_s",
            )
    return config


def _parse_restart(sec: Section) -> RestartConfig:
    config = RestartConfig(
        max_restarts=sec.optional("max_restarts", config_values.integer(0, 1_000_000)),
        window_s=sec.optional("window_s", config_values.seconds()),
        backoff_initial_s=sec.optional("backoff_initial_s", config_values.seconds(zero_ok=True)),
        backoff_max_s=sec.optional("backoff_max_s", config_values.seconds(zero_ok=True)),
        max_attempts_without_progress=sec.optional("max_attempts_without_progress", config_values.integer(1, 10**6)),
        stop_grace_s=sec.optional("stop_grace_s", config_values.seconds()),
    )
    if config.backoff_max_s < config.backoff_initial_s:
        sec.fail(
            "backoff_max_s",
            f"{config.backoff_max_s:g} is below restart.backoff_initial_s {config.backoff_initial_s:g}; "
            "raise backoff_max_s or lower backoff_initial_s",
        )
    return config


def _parse_eviction(sec: Section, base: Path) -> EvictionConfig:
    config = EvictionConfig(
        signals=sec.optional("signals", config_signals.signals),
        providers=sec.optional("providers", config_values.providers),
        endpoint=sec.nullable("endpoint", config_values.url),
        poll_interval_s=sec.optional("poll_interval_s", config_values.seconds()),
        default_deadline_s=sec.optional("default_deadline_s", config_values.seconds()),
        save_margin_s=sec.optional("save_margin_s", config_values.seconds(zero_ok=True)),
        file=sec.nullable("file", config_values.path(base)),
        command=sec.nullable("command", config_values.argv),
        requeue_command=sec.nullable("requeue_command", config_values.argv),
    )
    if config.save_margin_s >= config.default_deadline_s:
        sec.fail(
            "save_margin_s",
            f"{config.save_margin_s:g} leaves no time to save within eviction.default_deadline_s "
            f"{config.default_deadline_s:g}; lower save_margin_s or raise default_deadline_s",
        )
    return config
