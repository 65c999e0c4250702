"""Probe kept in the suite: a real `ftsup run` fed hostile input exposes no unbounded label and
listens only where `metrics.listen` says.

The job is tests/bin/hostile_rank.py under torchrun: it beats like a healthy rank and floods
the heartbeat socket with odd ranks, attempts, phases, thousands of distinct figure names and
malformed datagrams; the eviction command watcher flaps between blind and seeing with a new odd
reason (quotes, braces, non-ASCII) on every poll. Two scrapes, before and after more of that.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ftsup.protocol import DROP_REASONS
from ftsup.supervisor.policy import evidence, nodes
from ftsup.supervisor.policy.detectors import KINDS
from ftsup.supervisor.policy.goodput import CAUSES
from ftsup.supervisor.telemetry.logs import EVENTS
from ftsup.supervisor.telemetry.metrics import DURABLE_OUTCOMES, FAILURE_KINDS, PHASES, STORAGE_PURPOSES, TRIGGERS
from tests.procs import BIN, PYTHONPATH, REPO, free_port, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

RUN_ID = "probe-job"
NODE_ID = "probe-node"

# The count of polls is written whole (a rename): the test reads it while the next poll writes it.
FLAPPING_WATCHER = r"""
n=$(cat "$1" 2>/dev/null || echo 0); echo $((n + 1)) > "$1.new" && mv "$1.new" "$1"
if [ $((n % 2)) -eq 0 ]; then
  printf 'blind \342\230\203 "%s" {kind="x",source="%s"} %s\n' "$n" "$n" "$$" >&2; exit 1
fi
"""


def _series(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (s.name, tuple(sorted(s.labels.items()))) for fam in text_string_to_metric_families(text) for s in fam.samples
    }


def _listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("probe")
    port = free_port()
    progress, finish = tmp / "bursts", tmp / "finish"
    cfg = {
        "job": {
            "command": [sys.executable, str(BIN / "hostile_rank.py"), str(progress), str(finish)],
            "workdir": str(REPO),
            "state_dir": str(tmp / "state"),
            "run_id": RUN_ID,
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": 1, "node_id": NODE_ID},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "heartbeat": {"timeout_s": 60, "progress_timeout_s": 120, "startup_timeout_s": 120},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
        "eviction": {
            "signals": ["SIGTERM"],
            "poll_interval_s": 0.2,
            "command": ["sh", "-c", FLAPPING_WATCHER, "sh", str(tmp / "polls")],
        },
        "metrics": {"listen": f"127.0.0.1:{port}"},
    }
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def bursts() -> int:
        try:
            return int(progress.read_text())
        except (FileNotFoundError, ValueError):
            return 0

    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(tmp / "job.yaml")],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: bursts() >= 3, 120, "the rank never sent its hostile bursts")
        first = scrape()
        polls = int((tmp / "polls").read_text())
        wait_for(lambda: bursts() >= 8 and int((tmp / "polls").read_text()) >= polls + 6, 60, "no more input")
        second = scrape()
        listening = _listening(proc.pid)
        finish.touch()
        rc = proc.wait(timeout=60)
    finally:
        kill_tree(proc.pid)
    return {"first": first, "second": second, "listening": listening, "port": port, "rc": rc}


def test_the_probe_run_ends_as_its_job_does(probed):
    assert probed["rc"] == 0


def test_every_label_value_comes_from_a_fixed_set_or_the_nodes_own_ids(probed):
    allowed = {
        "event": EVENTS,
        "kind": {*FAILURE_KINDS.values(), *KINDS},
        "phase": set(PHASES),
        "stop": {"true", "false"},
        "source": {"command", "signal:SIGTERM"},
        "run_id": {RUN_ID},
        "node_id": {NODE_ID},
        "version": {metadata.version("ftsup")},
        "reason": set(DROP_REASONS),
        "purpose": set(STORAGE_PURPOSES),
        "trigger": set(TRIGGERS) | set(evidence.TRIGGERS),  # rollbacks and incidents
        "rank": {"0"},  # the node's one rank
        "cause": set(CAUSES),
        "outcome": set(DURABLE_OUTCOMES),
        "check": set(nodes.CHECKS),
        "result": set(nodes.RESULTS),
    }
    seen: dict[str, set[str]] = {}
    for _, labels in _series(probed["second"]):
        for name, value in labels:
            seen.setdefault(name, set()).add(value)
    assert {name: values - allowed.get(name, set()) for name, values in seen.items()} == {n: set() for n in seen}


def test_more_hostile_input_adds_no_series(probed):
    assert _series(probed["second"]) == _series(probed["first"])


def test_the_supervisor_listens_only_on_the_configured_address(probed):
    assert probed["listening"] == {("127.0.0.1", probed["port"])}


def test_the_hostile_messages_reached_the_supervisor_and_were_dropped(probed):
    dropped = {
        dict(s.labels)["reason"]: s.value
        for fam in text_string_to_metric_families(probed["second"])
        for s in fam.samples
        if s.name == "ftsup_heartbeats_dropped_total"
    }
    assert (dropped["malformed"] > 0, dropped["forged"] > 0, dropped["ahead"] > 0) == (True, True, True), dropped


def test_no_beat_it_forged_became_the_jobs_step(probed):
    steps = [
        s.value
        for fam in text_string_to_metric_families(probed["second"])
        for s in fam.samples
        if s.name == "ftsup_step"
    ]
    assert (len(steps), steps[0] < 10**6) == (1, True), steps
