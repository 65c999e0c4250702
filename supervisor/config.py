"""The job config: a YAML file turned into frozen dataclasses, or one `ConfigError` line saying what to fix.

`load_config(path)` reads a YAML file; `parse_config(mapping, ...)` validates a mapping that is already loaded.
Both return a `JobConfig` with one section per YAML section of ARCHITECTURE section 5: `job`, `launch`,
`checkpoint`, `heartbeat`, `restart`, `eviction`, `metrics`, `logging`. `deploy/examples/job.yaml` shows every key.

Rules (HOUSE_STYLE habit 4):
- unknown keys at any level, wrong types and impossible values are errors that name the key path and the fix,
  with a "did you mean" when a valid key is close; a bad file never falls back to defaults;
- every duration ends in `_s` and is in seconds (int or float in YAML, stored as float);
- relative paths resolve against the config file's directory, never the current directory;
- values are literal: no `${VAR}` or `~` expansion (both refused in paths), no environment variable is read here.

YAML is read as PyYAML's YAML 1.1 with two traps removed: an unquoted `1:2` is the string "1:2" (not the base-60
integer 62), so `nnodes: 1:2` means what it says; `1e3` is a number. A key given twice is an error, not "last wins".

This module decides nothing at runtime: `nproc_per_node: auto`, learned timeouts and `eviction.providers: [auto]`
are kept as written for the daemon to resolve. Its only I/O is reading the file and, when `launch.node_id` is
not set, asking for the hostname.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar
from urllib.parse import urlsplit

import yaml

from supervisor.errors import ConfigError

SECTIONS = ("job", "launch", "checkpoint", "heartbeat", "restart", "eviction", "metrics", "logging")
PROVIDERS = ("aws", "gcp", "azure")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")

_EXAMPLE = "deploy/examples/job.yaml"
# Ids name files, the rendezvous and FTSUP_RUN_ID: keep them to characters that are safe in all three.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# torchrun flags that ftsup derives from the config; passing them again would contradict it.
_TORCHRUN_OWNED = {
    "nnodes": "launch.nnodes",
    "nproc-per-node": "launch.nproc_per_node",
    "max-restarts": "restart.max_restarts (restarts are ftsup's decision; torchrun always gets 0)",
    "rdzv-backend": "nothing (ftsup always uses c10d)",
    "rdzv-endpoint": "launch.rdzv_endpoint",
    "rdzv-id": "launch.rdzv_id",
    "standalone": "nothing (leave launch.rdzv_endpoint unset for a single node)",
}


# --------------------------------------------------------------------------- the sections


@dataclass(frozen=True)
class JobSection:
    """`job:` what every rank runs, where, and under which id."""

    command: tuple[str, ...]
    """The training command as an argv list, run without a shell: `[python, -m, trainer.examples.gpt, --steps, "200"]`.
    Numbers must be quoted so that each argument is passed exactly as written."""
    workdir: Path
    """Working directory of the ranks. Default: the config file's directory; relative paths resolve against it."""
    run_id: str
    """Id of this job: names the journal, the default `launch.rdzv_id` and `FTSUP_RUN_ID`. Default: "ftsup-" + the
    first 8 hex digits of sha256 of the config file's absolute path. That default differs between nodes whose config
    files live at different paths, so multi-node jobs should set it (or `launch.rdzv_id`)."""
    state_dir: Path
    """This node's journal and runtime files. Default: `<workdir>/.ftsup/<launch.node_id>`."""
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
    """Ranks per node, or "auto": the daemon counts GPUs through NVML when present, else CPU slots."""
    nnodes: str = "1"
    """Node count in torchrun's form: "N", or "MIN:MAX" for an elastic job. YAML may give an int; stored as a string."""
    min_world_size: int = 1
    """The fewest ranks worth running with; below it the job waits or stops instead of launching."""
    max_world_size: int | None = None
    """The most ranks to use; null means `max_nodes * nproc_per_node` (see `max_world_size_for`)."""
    rdzv_endpoint: str | None = None
    """"host:port" of the c10d rendezvous. Required when `nnodes` allows more than one node; null = single node."""
    health_command: tuple[str, ...] | None = None
    """Optional argv printing the healthy local slot ids; null = every slot is taken as healthy (or NVML decides)."""
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
    """`checkpoint:` where the ranks' checkpoints live (the store of ARCHITECTURE section 2)."""

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
    """How long a rank may stay in phase save or load before it counts as hung."""
    min_timeout_s: float = 2.0
    """Floor of the learned timeouts, so that a run of fast steps does not make them hair-trigger."""
    step_time_multiplier: float = 3.0
    """Learned timeout = this x the p99 step time (at least 1)."""
    interval_s: float = 0.5
    """How often ranks beat while idle within a step; every timeout must be longer."""


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
    """"json" (one object per line, ARCHITECTURE section 5) or "console" (for people at a terminal)."""


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
        return _plain_dataclass(self)


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
    try:
        text = absolute.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file; pass the path of a job config (example: {_EXAMPLE})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text (bad byte at offset {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read it: {e.strerror or e}") from None
    raw = _load_yaml(text, source)
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
    top = _Where(source)
    if not isinstance(mapping, Mapping):
        top.fail(f"expected a mapping of sections ({', '.join(SECTIONS)}) at the top level, got {_describe(mapping)}")
    _check_keys(top, mapping, SECTIONS, noun="section")
    # Every section's keys are checked before any value, so a misspelt key is reported before what it causes.
    job = _Section(top.child("job"), mapping.get("job"), _field_names(JobSection))
    launch = _Section(top.child("launch"), mapping.get("launch"), _field_names(LaunchConfig))
    checkpoint = _Section(top.child("checkpoint"), mapping.get("checkpoint"), _field_names(CheckpointConfig))
    heartbeat = _Section(top.child("heartbeat"), mapping.get("heartbeat"), _field_names(HeartbeatConfig))
    restart = _Section(top.child("restart"), mapping.get("restart"), _field_names(RestartConfig))
    eviction = _Section(top.child("eviction"), mapping.get("eviction"), _field_names(EvictionConfig))
    metrics = _Section(top.child("metrics"), mapping.get("metrics"), _field_names(MetricsConfig))
    logging = _Section(top.child("logging"), mapping.get("logging"), _field_names(LoggingConfig))

    digest = hashlib.sha256(str(config_path if config_path is not None else base).encode()).hexdigest()
    run_id = job.optional("run_id", _identifier, f"ftsup-{digest[:8]}")
    launch_config = _parse_launch(launch, run_id=run_id, hostname=hostname)
    return JobConfig(
        job=_parse_job(job, base, run_id=run_id, node_id=launch_config.node_id),
        launch=launch_config,
        checkpoint=CheckpointConfig(
            dir=checkpoint.required("dir", _path(base), "set it to the checkpoint store directory, e.g. ./checkpoints"),
            verify_deep=checkpoint.optional("verify_deep", _boolean, False),
        ),
        heartbeat=_parse_heartbeat(heartbeat),
        restart=_parse_restart(restart),
        eviction=_parse_eviction(eviction, base),
        metrics=MetricsConfig(listen=metrics.nullable("listen", _host_port(min_port=0, example="0.0.0.0:9400"))),
        logging=LoggingConfig(
            dir=logging.nullable("dir", _path(base)),
            level=logging.optional("level", _choice(LOG_LEVELS), "info"),
            format=logging.optional("format", _choice(LOG_FORMATS), "json"),
        ),
        source=source,
    )


# --------------------------------------------------------------------------- section parsers


def _parse_job(sec: _Section, base: Path, *, run_id: str, node_id: str) -> JobSection:
    workdir = sec.optional("workdir", _path(base), base)
    return JobSection(
        command=sec.required("command", _argv, "give the training command as a list, e.g. [python, train.py]"),
        workdir=workdir,
        run_id=run_id,
        state_dir=sec.optional("state_dir", _path(base), workdir / ".ftsup" / node_id),
        env=sec.optional("env", _env, {}),
    )


def _parse_launch(sec: _Section, *, run_id: str, hostname: str | None) -> LaunchConfig:
    auto: Literal["auto"] = "auto"
    nproc = sec.optional("nproc_per_node", _nproc, auto)
    nnodes = sec.optional("nnodes", _nnodes, "1")
    min_world = sec.optional("min_world_size", _integer(1), 1)
    max_world = sec.nullable("max_world_size", _integer(1))
    node_id = sec.optional("node_id", _identifier, None)
    config = LaunchConfig(
        node_id=node_id if node_id is not None else _hostname(sec.where.child("node_id"), hostname),
        rdzv_id=sec.optional("rdzv_id", _identifier, run_id),
        nproc_per_node=nproc,
        nnodes=nnodes,
        min_world_size=min_world,
        max_world_size=max_world,
        rdzv_endpoint=sec.nullable("rdzv_endpoint", _host_port(min_port=1, example="node0:29400")),
        health_command=sec.nullable("health_command", _argv),
        torchrun_args=sec.optional("torchrun_args", _torchrun_args, ()),
        global_batch=sec.nullable("global_batch", _integer(1)),
        micro_batch=sec.nullable("micro_batch", _integer(1)),
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


def _check_batches(sec: _Section, config: LaunchConfig) -> None:
    """Refuse a global batch that no allowed world size can split evenly (ARCHITECTURE section 3)."""
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
    if not any(g % (w * per) == 0 for w in range(low, high + 1)):
        split = f"world_size x micro_batch {per}" if micro is not None else "world_size"
        sec.fail(
            "global_batch",
            f"{g} cannot be split evenly at any world size from {low} to {high} ({split} must divide it); "
            "choose a global_batch with such a divisor or widen the world size range",
        )


def _parse_heartbeat(sec: _Section) -> HeartbeatConfig:
    learned = "; leave it out (or null) to learn it from observed step times"
    config = HeartbeatConfig(
        timeout_s=sec.nullable("timeout_s", _seconds(fix=learned)),
        progress_timeout_s=sec.nullable("progress_timeout_s", _seconds(fix=learned)),
        startup_timeout_s=sec.optional("startup_timeout_s", _seconds(), 300.0),
        save_timeout_s=sec.optional("save_timeout_s", _seconds(), 900.0),
        min_timeout_s=sec.optional("min_timeout_s", _seconds(), 2.0),
        step_time_multiplier=sec.optional("step_time_multiplier", _number(low=1.0, low_ok=True, unit=""), 3.0),
        interval_s=sec.optional("interval_s", _seconds(), 0.5),
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


def _parse_restart(sec: _Section) -> RestartConfig:
    config = RestartConfig(
        max_restarts=sec.optional("max_restarts", _integer(0), 10),
        window_s=sec.optional("window_s", _seconds(), 3600.0),
        backoff_initial_s=sec.optional("backoff_initial_s", _seconds(zero_ok=True), 1.0),
        backoff_max_s=sec.optional("backoff_max_s", _seconds(zero_ok=True), 60.0),
        max_attempts_without_progress=sec.optional("max_attempts_without_progress", _integer(1), 3),
        stop_grace_s=sec.optional("stop_grace_s", _seconds(), 10.0),
    )
    if config.backoff_max_s < config.backoff_initial_s:
        sec.fail(
            "backoff_max_s",
            f"{config.backoff_max_s:g} is below restart.backoff_initial_s {config.backoff_initial_s:g}; "
            "raise backoff_max_s or lower backoff_initial_s",
        )
    return config


def _parse_eviction(sec: _Section, base: Path) -> EvictionConfig:
    config = EvictionConfig(
        signals=sec.optional("signals", _signals, ("SIGTERM", "SIGUSR1")),
        providers=sec.optional("providers", _providers, ()),
        endpoint=sec.nullable("endpoint", _url),
        poll_interval_s=sec.optional("poll_interval_s", _seconds(), 1.0),
        default_deadline_s=sec.optional("default_deadline_s", _seconds(), 30.0),
        save_margin_s=sec.optional("save_margin_s", _seconds(zero_ok=True), 5.0),
        file=sec.nullable("file", _path(base)),
        command=sec.nullable("command", _argv),
        requeue_command=sec.nullable("requeue_command", _argv),
    )
    if config.save_margin_s >= config.default_deadline_s:
        sec.fail(
            "save_margin_s",
            f"{config.save_margin_s:g} leaves no time to save within eviction.default_deadline_s "
            f"{config.default_deadline_s:g}; lower save_margin_s or raise default_deadline_s",
        )
    return config


# --------------------------------------------------------------------------- where errors point, sections


@dataclass(frozen=True)
class _Where:
    """A key path inside a source, for error messages: `job.yaml: restart.window_s: ...`."""

    source: str
    path: str = ""

    def child(self, key: str) -> _Where:
        return _Where(self.source, f"{self.path}.{key}" if self.path else key)

    def item(self, index: int) -> _Where:
        return _Where(self.source, f"{self.path}[{index}]")

    def fail(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.source}: {self.path}: {message}" if self.path else f"{self.source}: {message}")


_T = TypeVar("_T")
_D = TypeVar("_D")
_Parse = Callable[[object, _Where], _T]


class _Section:
    """One YAML section: its keys checked on construction, its values read through parse functions."""

    def __init__(self, where: _Where, raw: object, keys: Sequence[str]) -> None:
        if raw is None:  # `metrics:` with nothing under it: all defaults
            raw = {}
        if not isinstance(raw, Mapping):
            where.fail(f"expected a mapping with keys such as {', '.join(keys[:3])}, got {_describe(raw)}")
        _check_keys(where, raw, keys, noun="key")
        self.where = where
        self._raw = raw

    def fail(self, key: str, message: str) -> NoReturn:
        self.where.child(key).fail(message)

    def required(self, key: str, parse: _Parse[_T], fix: str) -> _T:
        if self._raw.get(key) is None:
            self.fail(key, f"required; {fix}")
        return parse(self._raw[key], self.where.child(key))

    def optional(self, key: str, parse: _Parse[_T], default: _D) -> _T | _D:
        if key not in self._raw:
            return default
        value = self._raw[key]
        if value is None:
            shown = "auto-detected" if default is None else _yaml_repr(default)
            self.fail(key, f"null is not allowed here; remove the key to use the default ({shown})")
        return parse(value, self.where.child(key))

    def nullable(self, key: str, parse: _Parse[_T]) -> _T | None:
        value = self._raw.get(key)
        return None if value is None else parse(value, self.where.child(key))


def _check_keys(where: _Where, raw: Mapping[Any, Any], keys: Sequence[str], *, noun: str) -> None:
    for key in raw:
        if not isinstance(key, str):
            where.fail(f"{_describe(key)} is not a valid {noun} name; expected one of {', '.join(keys)}")
        if key not in keys:
            where.child(key).fail(f"unknown {noun} ({_suggest(key, keys)})")


def _suggest(key: str, keys: Sequence[str]) -> str:
    normal = key.strip().lower().replace("-", "_")
    close = [normal] if normal in keys else difflib.get_close_matches(normal, keys, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(keys)}"


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


# --------------------------------------------------------------------------- value parsers


def _describe(value: object) -> str:
    """How a wrong value is shown in a message: its YAML spelling and kind."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return f"the string {shown!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"a {type(value).__name__} ({value!s})"


def _yaml_repr(value: object) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(minimum: int) -> _Parse[int]:
    def parse(value: object, where: _Where) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            hint = ""
            if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
                hint = "; write it without quotes"
            elif isinstance(value, float) and value.is_integer():
                hint = f"; write {int(value)}"
            where.fail(f"expected a whole number >= {minimum}, got {_describe(value)}{hint}")
        if value < minimum:
            where.fail(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _number(*, low: float, low_ok: bool, unit: str = " seconds", fix: str = "") -> _Parse[float]:
    def parse(value: object, where: _Where) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            what = "a number of seconds" if unit else "a number"
            hint = "; write a plain number (every *_s key is in seconds)" if unit and isinstance(value, str) else ""
            where.fail(f"expected {what}, got {_describe(value)}{hint}")
        number = float(value)
        if not math.isfinite(number):
            where.fail(f"{value!r} is not a finite number; write a finite value{fix}")
        if number < low or (number == low and not low_ok):
            bound = "at least" if low_ok else "above"
            where.fail(f"must be {bound} {low:g}{unit}, got {value!r}{fix}")
        return number

    return parse


def _seconds(*, zero_ok: bool = False, fix: str = "") -> _Parse[float]:
    return _number(low=0.0, low_ok=zero_ok, fix=fix)


def _boolean(value: object, where: _Where) -> bool:
    if not isinstance(value, bool):
        hint = "; write it without quotes" if isinstance(value, str) and value.lower() in ("true", "false") else ""
        where.fail(f"expected true or false, got {_describe(value)}{hint}")
    return value


def _string(value: object, where: _Where) -> str:
    if not isinstance(value, str):
        hint = "; quote it" if isinstance(value, int | float | bool) or not isinstance(value, list | Mapping) else ""
        where.fail(f"expected a string, got {_describe(value)}{hint}")
    if not value:
        where.fail("must not be empty")
    return value


def _identifier(value: object, where: _Where) -> str:
    text = _string(value, where)
    if not _ID.match(text):
        where.fail(
            f"{text!r} is not a valid id; use letters, digits, '.', '_' and '-', starting with a letter or digit"
        )
    return text


def _hostname(where: _Where, given: str | None) -> str:
    name = given if given is not None else socket.gethostname()
    if not _ID.match(name):
        where.fail(f"the hostname {name!r} is not a valid id; set launch.node_id explicitly")
    return name


def _choice(choices: Sequence[str]) -> _Parse[str]:
    def parse(value: object, where: _Where) -> str:
        text = _string(value, where).lower()
        if text not in choices:
            where.fail(f"{value!r} is not one of {', '.join(choices)} ({_suggest(text, choices)})")
        return text

    return parse


def _argument(value: object, where: _Where) -> str:
    if isinstance(value, str):
        return value
    if _is_number(value):
        where.fail(
            f'{_describe(value)} is not a string; quote it ("{value}") so the argument is passed exactly as written'
        )
    if value is None:
        where.fail('an empty item (null); remove it, or write "" for an empty argument')
    if isinstance(value, bool):
        where.fail(f"{_describe(value)} is not a string; quote it as written so the argument is passed as a string")
    where.fail(f"expected a string argument, got {_describe(value)}")


def _string_list(value: object, where: _Where, example: str = "[--flag, value]") -> tuple[str, ...]:
    if not isinstance(value, list):
        hint = "; split it into a list (no shell runs it)" if isinstance(value, str) else ""
        where.fail(f"expected a list of strings such as {example}, got {_describe(value)}{hint}")
    return tuple(_argument(item, where.item(i)) for i, item in enumerate(value))


def _argv(value: object, where: _Where) -> tuple[str, ...]:
    argv = _string_list(value, where, example="[python, train.py]")
    if not argv or not argv[0]:
        where.fail("needs at least a program name, e.g. [python, train.py]")
    return argv


def _torchrun_args(value: object, where: _Where) -> tuple[str, ...]:
    args = _string_list(value, where)
    for i, arg in enumerate(args):
        name = arg.partition("=")[0].lstrip("-").replace("_", "-")
        if arg.startswith("--") and name in _TORCHRUN_OWNED:
            where.item(i).fail(f"{arg!r} is set by ftsup; remove it and use {_TORCHRUN_OWNED[name]}")
    return args


def _env(value: object, where: _Where) -> dict[str, str]:
    if not isinstance(value, Mapping):
        where.fail(f"expected a mapping of NAME: value, got {_describe(value)}")
    env: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            where.fail(f"{name!r} is not a valid environment variable name (letters, digits, '_')")
        if not isinstance(item, str):
            where.child(name).fail(f"expected a string, got {_describe(item)}; quote it")
        env[name] = item
    return env


def _path(base: Path) -> _Parse[Path]:
    def parse(value: object, where: _Where) -> Path:
        text = _string(value, where)
        if text.startswith("~"):
            where.fail(f"{text!r}: '~' is not expanded here; write the full path")
        if "${" in text:
            where.fail(f"{text!r}: environment variables are not expanded in the config; write the value itself")
        if "\0" in text:
            where.fail("a path cannot contain a NUL character")
        return Path(os.path.normpath(base / text))

    return parse


def _nproc(value: object, where: _Where) -> int | Literal["auto"]:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str):
        where.fail(f"expected a whole number >= 1 or auto, got {_describe(value)}")
    return _integer(1)(value, where)


def _nnodes(value: object, where: _Where) -> str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        where.fail(f"expected a node count N or a range MIN:MAX such as 1:2, got {_describe(value)}")
    low, sep, high = str(value).strip().partition(":")
    if not low.isdigit() or (sep and not high.isdigit()):
        where.fail(f"{value!r} is not N or MIN:MAX (whole numbers), e.g. 2 or 1:2")
    lowest, highest = int(low), int(high or low)
    if lowest < 1:
        where.fail(f"{value!r}: the node count must be at least 1")
    if lowest > highest:
        where.fail(f"{value!r}: MIN {lowest} is above MAX {highest}; write {highest}:{lowest}")
    return str(lowest) if lowest == highest else f"{lowest}:{highest}"


def _host_port(*, min_port: int, example: str) -> _Parse[str]:
    def parse(value: object, where: _Where) -> str:
        if not isinstance(value, str):
            where.fail(f"expected a quoted host:port such as {example}, got {_describe(value)}")
        text = _string(value, where).strip()
        host, sep, port = text.rpartition(":")
        bare_host = host.removeprefix("[").removesuffix("]")
        if not sep or not bare_host or not port.isdigit():
            where.fail(f"{text!r} is not host:port, e.g. {example}")
        if not min_port <= int(port) <= 65535:
            where.fail(f"port {port} is outside {min_port}..65535")
        return text

    return parse


def _url(value: object, where: _Where) -> str:
    text = _string(value, where).strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        where.fail(f"{text!r} is not an http(s) URL such as http://127.0.0.1:8080")
    return text.rstrip("/")


def _signals(value: object, where: _Where) -> tuple[str, ...]:
    if not isinstance(value, list):
        where.fail(f"expected a list of signal names such as [SIGTERM, SIGUSR1], got {_describe(value)}")
    names: list[str] = []
    for i, item in enumerate(value):
        name = _signal_name(item, where.item(i))
        if name not in names:
            names.append(name)
    return tuple(names)


def _signal_name(value: object, where: _Where) -> str:
    if not isinstance(value, str) or not value.strip():
        hint = "; use the name, since numbers differ between platforms" if _is_number(value) else ""
        where.fail(f"expected a signal name such as SIGUSR1, got {_describe(value)}{hint}")
    name = value.strip().upper()
    name = name if name.startswith("SIG") else "SIG" + name
    known = signal.Signals.__members__
    if name not in known:
        suggestion = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        fix = f"did you mean {suggestion[0]!r}?" if suggestion else "`kill -l` lists them"
        where.fail(f"{value!r} is not a signal on this system ({fix})")
    canonical = known[name].name  # aliases such as SIGIOT become SIGABRT
    if canonical in ("SIGKILL", "SIGSTOP"):
        where.fail(f"{canonical} cannot be caught, so it can never deliver an eviction notice; remove it")
    return canonical


def _providers(value: object, where: _Where) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        where.fail(f"expected a list such as [aws] or auto, got {_describe(value)}")
    names: list[str] = []
    for i, item in enumerate(items):
        text = _string(item, where.item(i)).strip().lower()
        if text not in (*PROVIDERS, "auto"):
            where.item(i).fail(f"{item!r} is not a provider ({_suggest(text, (*PROVIDERS, 'auto'))})")
        if text not in names:
            names.append(text)
    if "auto" in names and len(names) > 1:
        where.fail("auto detects the provider; give auto alone or list the providers without it")
    return tuple(names)


def _plain_dataclass(value: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}


def _plain(value: object) -> object:
    if is_dataclass(value) and not isinstance(value, type):
        return _plain_dataclass(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships without type hints
    """SafeLoader without base-60 numbers and with duplicate keys refused."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                ident = (key_node.tag, key_node.value)
                if ident in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key_node.value!r} is given twice; keep one", key_node.start_mark
                    )
                seen.add(ident)
        return super().construct_mapping(node, deep=deep)


_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# PyYAML's own patterns minus the sexagesimal (`1:2` = 62) forms; floats as in YAML 1.2, so `1e3` is a number.
# Order matters: the first matching resolver wins, so integers are tried before floats.
_Loader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9_]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _load_yaml(text: str, source: str) -> object:
    try:
        return yaml.load(text, Loader=_Loader)  # safe: _Loader is a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        detail = e.problem or "cannot parse"
        if e.context:
            at = f" at line {e.context_mark.line + 1}" if e.context_mark is not None and e.problem_mark else ""
            detail += f" ({e.context}{at})"
        raise ConfigError(f"{source}: {where}invalid YAML: {detail}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {' '.join(str(e).split())}") from None
