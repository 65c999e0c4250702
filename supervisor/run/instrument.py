"""The ranks' auto-instrumentation as the supervisor starts it: the start-up hook's directory first on their
`PYTHONPATH`, and the collective timeout, in their environment (docs/design/auto-instrumentation.md). The hook is the
trainer's (`ftsup.trainer.auto.site`), found by path and never imported: the supervisor does not import the trainer.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

from ftsup import protocol
from ftsup.supervisor.config.job import JobConfig

TRAINER = "ftsup.trainer"
HOOK_DIR = ("auto", "site")  # under the trainer's package: the directory that holds its `sitecustomize.py`


def hook_dir() -> Path:
    """The directory that holds the ranks' start-up hook (`sitecustomize.py`); OSError when this installation has
    none."""
    spec = importlib.util.find_spec(TRAINER)  # imports `ftsup` (the namespace root), not the trainer
    where = list(spec.submodule_search_locations or ()) if spec is not None else []
    for root in where:
        found = Path(root).joinpath(*HOOK_DIR)
        if (found / "sitecustomize.py").is_file():
            return found
    raise FileNotFoundError(f"this ftsup installation has no {TRAINER}.{'.'.join(HOOK_DIR)}/sitecustomize.py")


def rank_env(cfg: JobConfig, env: Mapping[str, str]) -> dict[str, str]:
    """What the ranks' environment `env` gets for the auto-instrumentation: with `launch.instrument`, the hook's
    directory before the `PYTHONPATH` it has and the collective timeout; nothing without it."""
    if not cfg.launch.instrument:
        return {}
    path = [str(hook_dir()), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {
        "PYTHONPATH": os.pathsep.join(path),
        protocol.COLLECTIVE_TIMEOUT_ENV: repr(cfg.heartbeat.collective_timeout),
    }
