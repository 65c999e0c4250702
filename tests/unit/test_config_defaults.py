"""Each config default is declared once, on the config's dataclasses (`ftsup.supervisor.config.job`), and the rest
follows them: the policy's settings are derived from a config (`settings_from`) with no default of their own, and
deploy/examples/job.yaml, which documents every key with its default, agrees with the dataclasses (it shows every
key of every section, and each value it sets is the default unless its line marks the value as an example); a
default that the README, a page of docs/ or a deploy file quotes where it explains something is the dataclass's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ftsup.supervisor.config.job import (
    AnomalyConfig,
    CheckpointConfig,
    EvictionConfig,
    ForensicsConfig,
    HeartbeatConfig,
    HeartbeatMode,
    JobSection,
    LaunchConfig,
    LoggingConfig,
    MetricsConfig,
    RestartConfig,
    load_config,
    parse_config,
)
from ftsup.supervisor.policy.events import Settings, settings_from

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "examples" / "job.yaml"
HOST = "node-a"


def test_the_example_file_parses() -> None:
    config = load_config(EXAMPLE, hostname=HOST)
    assert (config.job.run_id, config.checkpoint.dir) == ("gpt-example", REPO / "deploy" / "examples" / "checkpoints")


def test_the_example_file_shows_the_real_defaults() -> None:
    config = load_config(EXAMPLE, hostname=HOST)
    shown = (
        config.heartbeat,
        config.restart,
        config.eviction,
        config.metrics,
        config.logging,
        config.anomaly,
        config.forensics,
    )
    assert shown == (
        HeartbeatConfig(),
        RestartConfig(),
        EvictionConfig(),
        MetricsConfig(),
        LoggingConfig(),
        AnomalyConfig(),
        ForensicsConfig(),
    )


SECTIONS = {
    "job": JobSection,
    "launch": LaunchConfig,
    "checkpoint": CheckpointConfig,
    "heartbeat": HeartbeatConfig,
    "restart": RestartConfig,
    "eviction": EvictionConfig,
    "metrics": MetricsConfig,
    "logging": LoggingConfig,
    "anomaly": AnomalyConfig,
    "forensics": ForensicsConfig,
}


def example_keys() -> dict[str, dict[str, bool]]:
    """The keys that the example file shows, by section: set (`  key: value`) or commented out (`  # key: ...`, a
    default that is computed), each with whether its line marks the value as an example."""
    shown: dict[str, dict[str, bool]] = {}
    for line in EXAMPLE.read_text().splitlines():
        if top := re.match(r"(\w+):", line):
            shown[top[1]] = {}
        elif shown and (key := re.match(r"  (?:# )?(\w+):", line)):
            shown[list(shown)[-1]][key[1]] = "# example" in line
    return shown


def default_of(cls: type, key: str) -> object:
    f = next(f for f in dataclasses.fields(cls) if f.name == key)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_the_example_file_shows_every_key_of_every_section() -> None:
    shown = example_keys()
    assert {name: sorted(keys) for name, keys in shown.items()} == {
        name: sorted(f.name for f in dataclasses.fields(cls)) for name, cls in SECTIONS.items()
    }


def test_every_key_the_example_file_sets_is_its_default_unless_marked_as_an_example() -> None:
    config = load_config(EXAMPLE, hostname=HOST)
    wrong = []
    for name, keys in example_keys().items():
        for f in dataclasses.fields(SECTIONS[name]):
            if keys.get(f.name) or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
                continue  # an example value, or a default that is computed (the file says how)
            if getattr(getattr(config, name), f.name) != default_of(SECTIONS[name], f.name):
                wrong.append(f"{name}.{f.name}")
    assert wrong == []


def test_the_policy_declares_no_default_of_a_config_key() -> None:
    own = {f.name for f in dataclasses.fields(Settings) if f.default is not dataclasses.MISSING}
    assert own == {"stop_margin_s", "assumed_save_bytes_per_s"}  # the policy's own margins, not config keys


def test_every_setting_of_the_policy_comes_from_the_config() -> None:
    raw = {
        "job": {"command": ["true"]},
        "checkpoint": {"dir": "ckpt"},
        "launch": {"nnodes": "1:3", "rdzv_endpoint": "node0:29400", "min_world_size": 2, "max_world_size": 5},
        "heartbeat": {
            "mode": "required",
            "timeout_s": 41,
            "progress_timeout_s": 42,
            "startup_timeout_s": 43,
            "save_timeout_s": 44,
            "min_timeout_s": 45,
            "step_time_multiplier": 46,
        },
        "restart": {
            "max_restarts": 47,
            "window_s": 48,
            "backoff_initial_s": 49,
            "backoff_max_s": 50,
            "max_attempts_without_progress": 51,
        },
        "eviction": {"save_margin_s": 12},
        "anomaly": {"loss_spike_factor": 3, "max_rollbacks": 52},
        "forensics": {"timeout_s": 7, "on_straggler": False},
    }
    expected = Settings(
        nproc_max=7,
        min_world_size=2,
        max_world_size=5,
        nnodes_max=3,
        standby=False,
        heartbeat_mode=HeartbeatMode.REQUIRED,
        heartbeat_timeout_s=41.0,
        progress_timeout_s=42.0,
        startup_timeout_s=43.0,
        save_timeout_s=44.0,
        min_timeout_s=45.0,
        step_time_multiplier=46.0,
        max_restarts=47,
        window_s=48.0,
        backoff_initial_s=49.0,
        backoff_max_s=50.0,
        max_attempts_without_progress=51,
        save_margin_s=12.0,
        anomaly=AnomalyConfig(loss_spike_factor=3.0, max_rollbacks=52),
        forensics=ForensicsConfig(timeout_s=7.0, on_straggler=False),
    )
    assert settings_from(parse_config(raw, base_dir=Path("/"), hostname=HOST), nproc_max=7) == expected


DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").rglob("*.md")),
    REPO / "deploy" / "README.md",
    REPO / "deploy" / "systemd" / "ftsup@.service",
]


def defaults_quoted_in_the_docs() -> list[tuple[str, str, float]]:
    """Every "section.key_s, N s" or "`section.key_s` (N s)" in the prose: a default quoted where it is explained."""
    quoted = r"`?(\w+)\.(\w+_s)`?(?:,| \()\s*(\d+(?:\.\d+)?) s\b"
    return [(m[1], m[2], float(m[3])) for doc in DOCS for m in re.finditer(quoted, doc.read_text())]


def test_the_defaults_the_docs_quote_are_the_dataclasses():
    quoted = defaults_quoted_in_the_docs()
    wrong = [(s, k, v) for s, k, v in quoted if v != default_of(SECTIONS[s], k)]
    assert (len(quoted) >= 4, wrong) == (True, [])  # without the count, a changed wording would pass unseen


def test_the_systemd_stop_timeout_leaves_room_for_a_save_and_the_ranks_stop_at_the_defaults():
    unit = (REPO / "deploy" / "systemd" / "ftsup@.service").read_text()
    stop_timeout = re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    assert stop_timeout is not None
    assert float(stop_timeout[1]) > EvictionConfig().default_deadline_s + RestartConfig().stop_grace_s
