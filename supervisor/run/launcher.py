"""Start one attempt under torchrun, and stop it so that nothing of it survives.

The command, the ranks' environment, the start behind the parent-death guard and the stop: docs/design/run-loop.md,
Launching an attempt. When to start or stop is the policy's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ftsup import guard, procs, protocol
from ftsup.supervisor import statedir
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.policy.anomaly import merge_skips
from ftsup.supervisor.run import instrument, ranklogs

pid_alive = procs.pid_alive


@dataclass(frozen=True)
class LaunchSpec:
    command: tuple[str, ...]  # the training command, e.g. (python, -m, ftsup.trainer.examples.gpt, ...)
    nproc: int
    nnodes: str = "1"  # "N" or "MIN:MAX"
    rdzv_endpoint: str | None = None
    rdzv_id: str = "ftsup"
    rdzv_conf: str | None = None
    extra_args: tuple[str, ...] = ()
    python: str | None = None  # interpreter that runs torchrun (default: the command's python, else ftsup's)
    log_dir: str | None = None  # torchrun's --log-dir: each rank's own output files
    standby: bool = False  # a hot spare (`launch.standby`): its torchrun never hosts the rendezvous store


def spec_from(cfg: JobConfig, nproc: int, log_dir: Path | None = None) -> LaunchSpec:
    ln = cfg.launch
    return LaunchSpec(
        command=job_command(cfg.job.command),
        nproc=nproc,
        nnodes=ln.nnodes,
        rdzv_endpoint=ln.rdzv_endpoint,
        rdzv_id=ln.rdzv_id,
        extra_args=tuple(ln.torchrun_args),
        log_dir=None if log_dir is None else str(log_dir),
        standby=ln.standby,
    )


def bare_pythons() -> frozenset[str]:
    """The names that mean this interpreter in `job.command[0]`: `python`, `python3`, `python3.N` of its version."""
    return frozenset({"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])})


def job_command(command: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`job.command` as the ranks run it: a bare `python`/`python3` becomes the interpreter ftsup runs under
    (`sys.executable`), so that `ftsup` started from a virtual environment that was never activated runs the job
    with that environment's torch, as torchrun runs its ranks with its own interpreter. A path is kept as given."""
    cmd = tuple(command)
    if cmd and cmd[0] in bare_pythons() and sys.executable:
        return (sys.executable, *cmd[1:])
    return cmd


SEPARATE_WORKER_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torchrun's workers bootstrap from a store of their own, not the agent's (docs/design/run-loop.md, The workers'
store); a value the environment gives stays."""


def rank_env(
    cfg: JobConfig,
    runtime_dir: Path,
    resume_step: int | None,
    base: Mapping[str, str],
    skips: tuple[tuple[int, int], ...] = (),
    resume_bound: int | None = None,
) -> dict[str, str]:
    """`base` (the supervisor's environment), `job.env`, then the channel to this supervisor; the attempt's mark
    (FTSUP_RUN_ID, FTSUP_NODE_ID, FTSUP_ATTEMPT) is added by `start`. The data skips in force (`skips`, and any
    that `base` or `job.env` give) are FTSUP_DATA_SKIPS; with the detectors on, FTSUP_KEEP_OLDER_THAN_STEPS keeps
    the history a rollback needs (unless `job.env` sets it)."""
    channel = protocol.channel_env(
        heartbeat_socket=str(runtime_dir / "heartbeat.sock"),
        interval_s=cfg.heartbeat.interval_s,
        control_file=str(runtime_dir / "control.json"),
        checkpoint_dir=str(cfg.checkpoint.dir),
        resume_step=resume_step,
    )
    channel[protocol.RESUME_BOUND_ENV] = "" if resume_bound is None else str(resume_bound)
    # A rank that dies of SIGSEGV, SIGBUS, SIGFPE or SIGABRT prints its Python stack first (unless the environment
    # says otherwise); torchrun prefixes each rank's lines so that `ranklogs` can tell them from its own.
    prefix = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": ranklogs.PREFIX_TEMPLATE}
    window = cfg.anomaly.detection_window_steps
    history = {protocol.KEEP_OLDER_THAN_STEPS_ENV: str(window)} if cfg.anomaly.enabled else {}
    defaults = {"PYTHONFAULTHANDLER": "1", **SEPARATE_WORKER_STORE}
    env = {**defaults, **base, **prefix, **history, **cfg.job.env, **channel, "PYTHONUNBUFFERED": "1"}
    env.update(durable_env(cfg))
    if cfg.checkpoint.memory is not None:
        env[protocol.MEMORY_TIER_ENV] = cfg.checkpoint.memory.tier(cfg.job.run_id).encode()
    if not cfg.checkpoint.dir_shared and cfg.launch.max_nodes > 1:  # with a durable tier or peer memories
        env[protocol.NODE_LOCAL_ENV] = "1"
    env.update(instrument.rank_env(cfg, env))
    if skips:
        try:  # a skip is never forgotten: the ones given from outside stay, unless they are not skips at all
            given = protocol.parse_data_skips(env.get(protocol.DATA_SKIPS_ENV, ""), protocol.DATA_SKIPS_ENV)
            env[protocol.DATA_SKIPS_ENV] = protocol.encode_data_skips(merge_skips(given, skips))
        except ValueError:  # not ranges, or too many together: the supervisor's (the rank refuses a bad value)
            env[protocol.DATA_SKIPS_ENV] = protocol.encode_data_skips(skips)
    return env


def durable_env(cfg: JobConfig) -> dict[str, str]:
    """The durable tier as the ranks see it: its location (`DURABLE_TIER_ENV`), the emergency save's fallback
    directory (`FALLBACK_DIR_ENV`), whether each node keeps its own checkpoint dir (`NODE_LOCAL_ENV`), and the
    endpoint the config gives (`AWS_ENDPOINT_URL_S3`, over one from outside). Without a tier: nothing (a store of one
    node is its own either way)."""
    tier = cfg.checkpoint.durable
    if tier is None:
        return {}
    env = {protocol.DURABLE_TIER_ENV: tier.url, protocol.DURABLE_TIMEOUT_ENV: repr(restore_timeout_s(cfg))}
    if tier.fallback_dir is not None:
        env[protocol.FALLBACK_DIR_ENV] = tier.fallback_dir
    if not cfg.checkpoint.dir_shared:
        env[protocol.NODE_LOCAL_ENV] = "1"
    if tier.endpoint_url is not None:
        env["AWS_ENDPOINT_URL_S3"] = tier.endpoint_url
    return env


def restore_timeout_s(cfg: JobConfig) -> float:
    """The longest a rank's load reads one checkpoint of the durable tier (DURABLE_TIMEOUT_ENV): its operation
    timeout, and at most half of `heartbeat.save_timeout_s`, so that a load passes over a checkpoint the tier cannot
    deliver (and reads the next newest) well before a rank silent in `load` counts as hung."""
    tier = cfg.checkpoint.durable
    limit = cfg.heartbeat.save_timeout_s / 2
    return min(tier.operation_timeout_s, limit) if tier is not None else limit


def _is_python(exe: str) -> bool:
    return Path(exe).name.startswith("python")


def torchrun_argv(spec: LaunchSpec) -> list[str]:
    """The full argv: `<python> -m torch.distributed.run <torchrun options> --no-python <guard> <command>`."""
    cmd = list(spec.command)
    python = spec.python or (cmd[0] if cmd and _is_python(cmd[0]) else sys.executable)
    argv = [python, "-m", "torch.distributed.run", f"--nnodes={spec.nnodes}", f"--nproc-per-node={spec.nproc}"]
    argv += ["--max-restarts=0", "--monitor-interval=0.1"]
    if spec.log_dir:
        argv += [f"--log-dir={spec.log_dir}", "--tee=3"]
    extra = list(spec.extra_args)
    if spec.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--rdzv-id={spec.rdzv_id}"]
        conf = spec.rdzv_conf
        if spec.standby:
            # The store lives in an active node's torchrun: a closed round's store then goes with the nodes that
            # closed it, and never outlives them in a spare to refuse the next round (`conf` or the user's own).
            given, extra = _take_rdzv_conf(extra)
            conf = ",".join(x for x in (given if given is not None else conf, "is_host=false") if x)
        if conf:
            argv.append(f"--rdzv-conf={conf}")
    else:
        argv.append("--standalone")
    argv += extra
    # Each rank execs the guard, which arms its parent-death signal and checks that torchrun is
    # still its parent before exec'ing the command: a rank can never outlive torchrun, even
    # when torchrun dies while the rank is still importing torch.
    return [*argv, "--no-python", *guard.command(cmd)]


def _take_rdzv_conf(args: list[str]) -> tuple[str | None, list[str]]:
    """The value of the last `--rdzv-conf` in `args` (either spelling, `=VALUE` or a separate word), and `args`
    without any of them."""
    value, rest, i = None, [], 0
    while i < len(args):
        name, eq, given = args[i].partition("=")
        if name in ("--rdzv-conf", "--rdzv_conf"):
            if eq:
                value = given
            elif i + 1 < len(args):
                value, i = args[i + 1], i + 1
        else:
            rest.append(args[i])
        i += 1
    return value, rest


@dataclass(frozen=True)
class Launch:
    """An attempt to start: its number, torchrun's `argv` (`torchrun_argv`), where and with what environment it
    runs, the log file its output goes to, and the mark its processes carry."""

    number: int
    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str | os.PathLike[str]
    log_path: Path
    mark: procs.Mark

    def environ(self, guard_env: Mapping[str, str]) -> dict[str, str]:
        """The environment torchrun starts with: `env`, the mark's variables and the guard's (`guard.wrap`)."""
        return {**self.env, **self.mark.environ(), **guard_env}


@dataclass
class RunningAttempt:
    number: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float  # wall clock, just before torchrun was started
    mark: procs.Mark
    known_pids: set[int] = field(default_factory=set)  # pids claimed in heartbeats: never signalled as such
    _ranks: tuple[psutil.Process, ...] = field(default=(), repr=False)  # what `rank_pids` found last

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def rank_pids(self) -> frozenset[int]:
        """torchrun's direct children: the rank processes of the current worker group. torchrun replaces a group
        whole, stopping its ranks first, so while each rank found last is still its live child the group is the
        same, and the node's whole process table (what finding a process's children reads) is not read again."""
        if not (self._ranks and all(self._still_a_rank(p) for p in self._ranks)):
            try:
                self._ranks = tuple(c for c in psutil.Process(self.proc.pid).children() if procs.alive(c))
            except psutil.NoSuchProcess:
                self._ranks = ()
        return frozenset(p.pid for p in self._ranks)

    def _still_a_rank(self, p: psutil.Process) -> bool:
        try:
            return procs.alive(p) and p.ppid() == self.proc.pid
        except psutil.NoSuchProcess:
            return False

    def tree(self) -> list[psutil.Process]:
        """Every live process of this attempt: torchrun and its descendants (we started them),
        and the processes that carry the attempt's mark (a rank left to a reaper)."""
        root: list[int] = [] if self.proc.poll() is not None else [self.proc.pid]
        found = {p.pid: p for p in procs.descendants(root)}
        for p in procs.find(self.mark, since=self.started_at):
            found.setdefault(p.pid, p)
        return list(found.values())

    def stop(self, grace_s: float, *, clock: Callable[[], float] = time.monotonic, one_node: bool = False) -> list[int]:
        """Stop every process of the attempt (`procs.stop`); return the pids that survived.

        `one_node`: torchrun has no peer to take leave of (a single-node job), so once it is the attempt's last
        process it gets SIGKILL instead of the rest of the grace: its own shutdown (it stops ranks that are gone
        already, then a half-second's exit of an interpreter that holds torch) is no one's."""

        def found() -> list[psutil.Process]:
            tree = self.tree()
            if one_node and [p.pid for p in tree] == [self.proc.pid]:
                procs.signal_all(tree, signal.SIGKILL)
            return tree

        left = procs.stop(found, grace_s, clock=clock, reap=self.proc.poll)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return left


def start(launch: Launch, *, ignore_signals: tuple[int, ...] = ()) -> RunningAttempt:
    """Start the attempt `launch` (torchrun) behind the parent-death guard, in a session of its own.

    Notice signals (`ignore_signals`) are the supervisor's. Slurm delivers a step's signals to
    every process in it, and SIGUSR1's default action would kill torchrun and the ranks before
    they could save; the guard sets them to SIG_IGN before exec, which survives exec, so the
    whole tree ignores them.
    """
    wrapped, guard_env = guard.wrap(launch.argv, ignore=ignore_signals)
    started_at = time.time()
    with statedir.open_append(launch.log_path) as out:
        proc = subprocess.Popen(
            wrapped,
            env=launch.environ(guard_env),
            cwd=launch.cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return RunningAttempt(launch.number, proc, launch.log_path, started_at, launch.mark)
