"""The policy's settings as tests build them: `settings_from` over a config that sets nothing it need not, then
the fields a test names replaced. No default is written here: a test runs on the ones `ftsup run` would use."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ftsup.supervisor.config.job import CheckpointConfig, JobConfig, JobSection, LaunchConfig
from ftsup.supervisor.policy.events import Settings, settings_from

DEFAULTS = JobConfig(
    job=JobSection(command=("true",), workdir=Path("job"), run_id="test", state_dir=Path("job/state")),
    launch=LaunchConfig(node_id="node", rdzv_id="test"),
    checkpoint=CheckpointConfig(dir=Path("job/ckpt")),
)


def settings(nproc_max: int = 2, **overrides: Any) -> Settings:
    """The settings of a default config on a node of `nproc_max` slots, with `overrides` (field=value) applied."""
    return dataclasses.replace(settings_from(DEFAULTS, nproc_max), **overrides)
