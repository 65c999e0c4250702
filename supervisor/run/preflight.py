"""Checks of a valid job config against this host, made by `ftsup run` before it starts anything: one `ConfigError`
naming the key for the first mistake (docs/design/run-loop.md, Checks before start). It changes nothing.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from ftsup import extras
from ftsup.store.errors import os_words
from ftsup.supervisor.config.durable import DurableConfig
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.config.values import Where, file_kind
from ftsup.supervisor.run import instrument, launcher, memroom


def check(cfg: JobConfig, environ: Mapping[str, str] | None = None) -> None:
    """Raise `ConfigError` for the first key whose path or program cannot serve on this host."""
    top = Where(cfg.source)
    env = dict(os.environ if environ is None else environ)
    env.update(cfg.job.env)
    workdir = Path(cfg.job.workdir)
    existing_directory(top.child("job").child("workdir"), workdir)
    directory_or_creatable(top.child("checkpoint").child("dir"), Path(cfg.checkpoint.dir))
    if (tier := cfg.checkpoint.durable) is not None:
        durable_tier(cfg.source, tier)
    directory_or_creatable(top.child("job").child("state_dir"), Path(cfg.job.state_dir))
    memroom.check(cfg)
    if cfg.logging.dir is not None:
        directory_or_creatable(top.child("logging").child("dir"), Path(cfg.logging.dir))
    if cfg.launch.instrument:
        try:
            instrument.hook_dir()
        except OSError as e:
            top.child("launch").child("instrument").fail(f"{e}; reinstall ftsup, or run without it (--no-instrument)")
    command = top.child("job").child("command")
    argv = launcher.job_command(cfg.job.command)
    path = env.get("PATH", os.defpath)
    program(command.item(0), argv[0], workdir=workdir, path=path)
    interpreter = launcher.torchrun_argv(launcher.LaunchSpec(command=argv, nproc=1))[0]
    if interpreter != argv[0]:
        program(command, interpreter, workdir=workdir, path=path, role="the Python that runs torchrun")
        torch_importable(command, interpreter, "the Python that runs torchrun (ftsup's own)", env=env, workdir=workdir)
    else:
        named = cfg.job.command[0]
        role = f"{named!r} (the interpreter ftsup runs under)" if named != argv[0] else repr(named)
        torch_importable(command.item(0), interpreter, role, env=env, workdir=workdir)


def durable_tier(source: str, tier: DurableConfig) -> None:
    """An `s3://` tier needs boto3 (the `durable` extra): `MissingExtraError` naming it, before anything starts
    rather than at the first upload; a tier on a filesystem, and the emergency save's fallback directory, must be
    directories, or ones that can be created."""
    if tier.is_s3:
        extras.require("durable", f"{source}: checkpoint.durable ({tier.url})")
    else:
        directory_or_creatable(Where(source).child("checkpoint").child("durable").child("url"), Path(tier.url))
    if tier.fallback_dir is not None:
        where = Where(source).child("checkpoint").child("durable").child("fallback_dir")
        directory_or_creatable(where, Path(tier.fallback_dir))


PROBE_TIMEOUT_S = 60.0
_FIND_TORCH = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"


def torch_importable(where: Where, interpreter: str, role: str, *, env: Mapping[str, str], workdir: Path) -> None:
    """`interpreter` finds torch with the ranks' environment, in their directory (found, not imported: a few
    milliseconds). One line naming the interpreter otherwise."""
    exe = _resolved(interpreter, workdir=workdir, path=env.get("PATH", os.defpath))
    who = role if exe in role else f"{role} ({exe})"
    try:
        done = subprocess.run(
            [exe, "-c", _FIND_TORCH],
            env=dict(env),
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        where.fail(f"{who} cannot be run to look for torch: {os_words(e) if isinstance(e, OSError) else e}")
    if done.returncode == 3:
        fix = f"install torch for it ({exe} -m pip install torch), or name an interpreter that has it by its path"
        if exe != sys.executable:
            fix += f" (ftsup runs under {sys.executable})"
        where.fail(f"{who} cannot import torch, which torchrun and the ranks need: {fix}")
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        where.fail(
            f"{who} failed to look for torch (exit status {done.returncode})"
            + (f": {_short(said[-1])}" if said else "")
        )


def _resolved(name: str, *, workdir: Path, path: str) -> str:
    """`name` as `program` found it: a path against `workdir`, else the first executable on `path`."""
    if "/" in name:
        return str(workdir / name)
    for entry in path.split(os.pathsep):
        candidate = workdir / (entry or ".") / name
        if _not_executable(candidate) is None:
            return str(candidate)
    return name


def existing_directory(where: Where, path: Path) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        where.fail(f"{path} does not exist; create it or correct the path (it is never created)")
    except NotADirectoryError:
        where.fail(f"{path}: {_blocking_file(path)} is a file, not a directory")
    except OSError as e:
        where.fail(f"{path}: cannot look at it: {os_words(e)}")
    if not stat.S_ISDIR(st.st_mode):
        where.fail(f"{path} is {file_kind(st.st_mode)}, not a directory")
    if not os.access(path, os.X_OK):
        where.fail(f"{path}: this user (uid {os.getuid()}) may not enter it")


def directory_or_creatable(where: Where, path: Path) -> None:
    """`path` is a directory this user can use, or it can be created: its nearest existing ancestor is one."""
    here = path
    while True:
        try:
            st = os.stat(here)  # follows links: a store that is a symlink to a directory is the operator's choice
            break
        except (FileNotFoundError, NotADirectoryError):
            if here.parent == here:
                where.fail(f"{path}: no part of it exists")
            here = here.parent
        except OSError as e:
            where.fail(f"{path}: cannot look at {here}: {os_words(e)}")
    if not stat.S_ISDIR(st.st_mode):
        on_the_way = "" if here == path else f" (on the way to {path})"
        where.fail(f"{here}{on_the_way} is {file_kind(st.st_mode)}, not a directory")
    needed = os.R_OK | os.W_OK | os.X_OK if here == path else os.W_OK | os.X_OK
    if not os.access(here, needed):
        what = "use" if here == path else f"create {path} in"
        where.fail(f"this user (uid {os.getuid()}) may not {what} {here} (permissions, or a read-only filesystem)")


def program(where: Where, name: str, *, workdir: Path, path: str, role: str = "the training command") -> None:
    """`name` runs as a program for the ranks: a path (relative to `workdir`) or a name found on `path`."""
    if "/" in name:
        candidate = workdir / name
        problem = _not_executable(candidate)
        if problem:
            where.fail(f"{name!r} ({role}, resolved against job.workdir: {candidate}) {problem}")
        return
    for entry in path.split(os.pathsep):
        candidate = workdir / (entry or ".") / name  # an empty PATH entry is the current directory
        if _not_executable(candidate) is None:
            return
    where.fail(
        f"{name!r} ({role}) is not found on PATH as the ranks see it ({_short(path)}); correct the name, give a "
        "full path, or set job.env.PATH"
    )


def _not_executable(path: Path) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return "does not exist"
    if not stat.S_ISREG(st.st_mode):
        return f"is {file_kind(st.st_mode)}, not a program"
    if not os.access(path, os.X_OK):
        return "is not executable (chmod +x it)"
    return None


def _blocking_file(path: Path) -> Path:
    """The ancestor of `path` that exists and is not a directory."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return path


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
