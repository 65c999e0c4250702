"""The job config: a YAML file turned into frozen dataclasses, or one `ConfigError` line saying what to fix.

`load_config(path)` reads a YAML file; `parse_config(mapping, ...)` validates a mapping that is already loaded.
Both return a `JobConfig` with one section per YAML section (DESIGN.md, Contracts): `job`, `launch`,
`checkpoint`, `heartbeat`, `restart`, `eviction`, `metrics`, `logging`. `deploy/examples/job.yaml` shows every key.

Rules (STYLE.md, Config):
- unknown keys at any level, wrong types and impossible values are errors that name the key path and the fix,
  with a "did you mean" when a valid key is close; a bad file never falls back to defaults;
- every duration ends in `_s` and is in seconds (int or float in YAML, stored as float);
- relative paths resolve against the config file's directory, never the current directory;
- values are literal: no `${VAR}` or `~` expansion (both refused in paths); the only environment variable read is
  systemd's `STATE_DIRECTORY`, for the default `job.state_dir`.

YAML is read as PyYAML's YAML 1.1 with two traps removed: an unquoted `1:2` is the string "1:2" (not the base-60
integer 62), so `nnodes: 1:2` means what it says; `1e3` is a number. A key given twice is an error, not "last wins".

This module knows the sections: their keys, defaults and the rules between keys. How a single value is read and
how its errors are worded (`Where`, `Section`, the parse functions, the YAML loader) is `config_values`.

This module decides nothing at runtime: `nproc_per_node: auto`, learned timeouts and `eviction.providers: [auto]`
are kept as written for the daemon to resolve. Its only I/O is reading the file and, when `launch.node_id` is
not set, asking for the hostname.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ftsup.supervisor import config_file, config_values, statedir
from ftsup.supervisor.config_values import Section, Where
from ftsup.supervisor.errors import ConfigError
from ftsup.supervisor.policy_io import Settings

SECTIONS = ("job", "launch", "checkpoint", "heartbeat", "restart", "eviction", "metrics", "logging")
PROVIDERS = config_values.PROVIDERS  # eviction.providers, checked in config_values
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")

_EXAMPLE = "deploy/examples/job.yaml"
MAX_WORLD_SIZE = 1_000_000


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
class LaunchConfig:
    """`launch:` how torchrun is started on this node and which world sizes are acceptable."""

    node_id: str
    """This node's name in logs, metrics and `job.state_dir`. Default: the hostname."""
    rdzv_id: str
    """torchrun's rendezvous id; equal on every node of the job. Default: `job.run_id`."""
    nproc_per_node: int | Literal["auto"] = "auto"
    """Ranks per node, or "auto": the daemon counts GPUs with `nvidia-smi` when present, else CPU slots."""
    nnodes: str = "1"
    """Node count in torchrun's form: "N", or "MIN:MAX" for an elastic job. YAML may give an int; stored as a string."""
    min_world_size: int = 1
    """The fewest ranks worth running with; below it the job waits or stops instead of launching."""
    max_world_size: int | None = None
    """The most ranks to use; null means `max_nodes * nproc_per_node` (see `max_world_size_for`)."""
    rdzv_endpoint: str | None = None
    """"host:port" of the c10d rendezvous. Required when `nnodes` allows more than one node; null = single node."""
    health_command: tuple[str, ...] | None = None
    """Optional argv printing the healthy local slot ids; null = every slot is taken as healthy (or `nvidia-smi`
    decides)."""
    torchrun_args: tuple[str, ...] = ()
    """Extra torchrun flags (for example `--local-addr=...`). Flags that ftsup derives from this config are refused."""
    global_batch: int | None = None
    """Samples per optimizer step, kept constant across world sizes: the world size is chosen to divide it. Null = read
    it from the checkpoint's metadata."""
    micro_batch: int | None = None
    """Samples per rank per forward pass; when set with `global_batch`, world_size x micro_batch must divide
    global_batch."""

    @property
    def min_nodes(self) -> int:
        """The MIN of `nnodes` (N when it is a single number)."""
        return int(self.nnodes.partition(":")[0])

    @property
    def max_nodes(self) -> int:
        """The MAX of `nnodes` (N when it is a single number)."""
        low, _, high = self.nnodes.partition(":")
        return int(high or low)

    def max_world_size_for(self, nproc_per_node: int) -> int:
        """The largest world size allowed once "auto" is resolved to `nproc_per_node` ranks per node."""
        cap = self.max_nodes * nproc_per_node
        return cap if self.max_world_size is None else min(cap, self.max_world_size)


@dataclass(frozen=True)
class CheckpointConfig:
    """`checkpoint:` where the ranks' checkpoints live (the checkpoint store, `ftsup/store/DESIGN.md`)."""

    dir: Path
    """The checkpoint store, shared by every node of a multi-node job. Relative paths resolve against the config
    file's directory."""
    verify_deep: bool = False
    """Check every checksum of the chosen checkpoint before each relaunch (slower; the fast check reads sizes only)."""


@dataclass(frozen=True)
class HeartbeatConfig:
    """`heartbeat:` when a silent or stuck rank counts as hung. Null timeouts are learned from observed step times."""

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


@dataclass(frozen=True)
class RestartConfig:
    """`restart:` the restart budget, backoff and crash-loop breaker."""

    max_restarts: int = 10
    """Restarts allowed within `window_s`; one more and the job stops (failure)."""
    window_s: float = 3600.0
    """The sliding window over which `max_restarts` is counted."""
    backoff_initial_s: float = 1.0
    """Wait before the first restart; doubles after each failed attempt."""
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
    """`logging:` the supervisor's own log lines (rank output goes to per-attempt files regardless)."""

    dir: Path | None = None
    """Directory for log files; null lets the daemon choose (under `job.state_dir`)."""
    level: str = "info"
    """One of debug, info, warning, error."""
    format: str = "json"
    """stderr: "json" (DESIGN.md, Contracts), but a short line per change of state on a terminal; "console": those
    lines wherever stderr goes. The log file is JSON either way."""


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
    source = os.fspath(path)
    absolute = Path(os.path.abspath(source))
    raw = config_file.load_yaml(config_file.read_text(source, absolute, example=_EXAMPLE), source)
    if raw is None:
        raise ConfigError(
            f"{source}: the file is empty (or only comments); a job config needs at least job.command "
            f"and checkpoint.dir (example: {_EXAMPLE})"
        )
    return parse_config(raw, source=source, base_dir=absolute.parent, config_path=absolute, hostname=hostname)


def parse_config(
    mapping: object,
    *,
    source: str = "<string>",
    base_dir: Path | None = None,
    config_path: Path | None = None,
    hostname: str | None = None,
) -> JobConfig:
    """Validate an already-loaded mapping (the YAML document) into a `JobConfig`.

    `source` prefixes every error message. `base_dir` is what relative paths resolve against (None: the current
    directory). `config_path` is hashed into the default `job.run_id` (None: `base_dir` is). `hostname` is the
    default `launch.node_id` (None: `socket.gethostname()`, asked only when needed).
    """
    base = Path(os.path.abspath(base_dir if base_dir is not None else os.curdir))
    top = Where(source)
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

    digest = hashlib.sha256(str(config_path if config_path is not None else base).encode()).hexdigest()
    run_id = job.optional("run_id", config_values.identifier, f"ftsup-{digest[:8]}")
    launch_config = _parse_launch(launch, run_id=run_id, hostname=hostname)
    return JobConfig(
        job=_parse_job(job, base, run_id=run_id, node_id=launch_config.node_id, config_path=config_path),
        launch=launch_config,
        checkpoint=CheckpointConfig(
            dir=checkpoint.required(
                "dir", config_values.path(base), "set it to the checkpoint store directory, e.g. ./checkpoints"
            ),
            verify_deep=checkpoint.optional("verify_deep", config_values.boolean),
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
        ),
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


def _parse_launch(sec: Section, *, run_id: str, hostname: str | None) -> LaunchConfig:
    nproc = sec.optional("nproc_per_node", config_values.nproc)
    nnodes = sec.optional("nnodes", config_values.nnodes)
    min_world = sec.optional("min_world_size", config_values.integer(1, MAX_WORLD_SIZE))
    max_world = sec.nullable("max_world_size", config_values.integer(1, MAX_WORLD_SIZE))
    node_id = sec.optional("node_id", config_values.identifier, None)
    config = LaunchConfig(
        node_id=node_id if node_id is not None else _hostname(sec.where.child("node_id"), hostname),
        rdzv_id=sec.optional("rdzv_id", config_values.identifier, run_id),
        nproc_per_node=nproc,
        nnodes=nnodes,
        min_world_size=min_world,
        max_world_size=max_world,
        rdzv_endpoint=sec.nullable("rdzv_endpoint", config_values.host_port(min_port=1, example="node0:29400")),
        health_command=sec.nullable("health_command", config_values.argv),
        torchrun_args=sec.optional("torchrun_args", config_values.torchrun_args),
        global_batch=sec.nullable("global_batch", config_values.integer(1, 2**40)),
        micro_batch=sec.nullable("micro_batch", config_values.integer(1, 2**40)),
    )

    if max_world is not None and min_world > max_world:
        sec.fail("min_world_size", f"{min_world} is above launch.max_world_size {max_world}; lower min_world_size")
    if isinstance(nproc, int) and min_world > (cap := config.max_nodes * nproc):
        sec.fail(
            "min_world_size",
            f"{min_world} is above the maximum world size {cap} (nnodes max {config.max_nodes} x nproc_per_node "
            f"{nproc}); lower min_world_size",
        )
    if config.max_nodes > 1 and config.rdzv_endpoint is None:
        sec.fail(
            "rdzv_endpoint",
            f"required when nnodes ({nnodes}) allows more than one node; set it to the rendezvous host:port, "
            "e.g. node0:29400",
        )
    _check_batches(sec, config)
    return config


def _check_batches(sec: Section, config: LaunchConfig) -> None:
    """Refuse a global batch that no allowed world size can split evenly (the world size must divide it)."""
    g, micro = config.global_batch, config.micro_batch
    if g is None:
        return
    if micro is not None and g % micro:
        sec.fail("global_batch", f"{g} is not a multiple of launch.micro_batch {micro}; change one of them")
    per = micro or 1
    if isinstance(config.nproc_per_node, int):
        high = config.max_world_size_for(config.nproc_per_node)
    elif config.max_world_size is not None:
        high = config.max_world_size
    else:
        return  # the upper bound is known only once "auto" is resolved; the daemon clamps then
    low = config.min_world_size
    if g % per or not any(low <= w <= high for w in _divisors(g // per)):
        split = f"world_size x micro_batch {per}" if micro is not None else "world_size"
        sec.fail(
            "global_batch",
            f"{g} cannot be split evenly at any world size from {low} to {high} ({split} must divide it); "
            "choose a global_batch with such a divisor or widen the world size range",
        )


def _divisors(n: int) -> list[int]:
    """Every divisor of `n` >= 1 (about 2 sqrt(n) steps: world size ranges can span a million)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in small]


def _hostname(where: Where, given: str | None) -> str:
    """The default `launch.node_id`: `given`, else the hostname (this module's one I/O besides reading the file)."""
    name = given if given is not None else socket.gethostname()
    if len(name) > config_values.MAX_ID_CHARS or not config_values.ID.match(name):
        where.fail(f"the hostname {name!r} is not a valid id; set launch.node_id explicitly")
    return name


def _parse_heartbeat(sec: Section) -> HeartbeatConfig:
    learned = "; leave it out (or null) to learn it from observed step times"
    config = HeartbeatConfig(
        timeout_s=sec.nullable("timeout_s", config_values.seconds(fix=learned)),
        progress_timeout_s=sec.nullable("progress_timeout_s", config_values.seconds(fix=learned)),
        startup_timeout_s=sec.optional("startup_timeout_s", config_values.seconds()),
        save_timeout_s=sec.optional("save_timeout_s", config_values.seconds()),
        min_timeout_s=sec.optional("min_timeout_s", config_values.seconds()),
        step_time_multiplier=sec.optional(
            "step_time_multiplier", config_values.number(low=1.0, low_ok=True, high=1000.0, unit="")
        ),
        interval_s=sec.optional("interval_s", config_values.seconds()),
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
        signals=sec.optional("signals", config_values.signals),
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


def settings_from(cfg: JobConfig, nproc_max: int) -> Settings:
    """The policy's settings: this config, with `launch.nproc_per_node` resolved to `nproc_max`."""
    hb, rs, ln = cfg.heartbeat, cfg.restart, cfg.launch
    return Settings(
        nproc_max=nproc_max, min_world_size=ln.min_world_size, max_world_size=ln.max_world_size,
        nnodes_max=ln.max_nodes, heartbeat_timeout_s=hb.timeout_s, progress_timeout_s=hb.progress_timeout_s,
        startup_timeout_s=hb.startup_timeout_s, save_timeout_s=hb.save_timeout_s, min_timeout_s=hb.min_timeout_s,
        step_time_multiplier=hb.step_time_multiplier, max_restarts=rs.max_restarts, window_s=rs.window_s,
        backoff_initial_s=rs.backoff_initial_s, backoff_max_s=rs.backoff_max_s,
        max_attempts_without_progress=rs.max_attempts_without_progress, save_margin_s=cfg.eviction.save_margin_s,
    )  # fmt: skip
