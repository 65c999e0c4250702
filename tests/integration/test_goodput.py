"""Goodput accounting in a real `ftsup run`: the reference trainer on real torchrun and gloo, a rank SIGKILLed
after step 7 (resumed from the checkpoint of step 4), the metrics endpoint scraped as the run goes and
`ftsup status --json` read at the end. One run, several claims about it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftsup.supervisor.policy.goodput import CAUSES
from tests.integration.test_supervisor import events, ftsup, write_job
from tests.procs import REPO, free_port, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess


def scrape(url: str) -> dict[str, Any] | None:
    """The goodput figures of one scrape (None: the endpoint did not answer)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    got: dict[str, Any] = {"badput_s": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ftsup_productive_seconds_total":
                got["productive_s"] = sample.value
            elif sample.name == "ftsup_badput_seconds_total":
                got["badput_s"][sample.labels["cause"]] = sample.value
            elif sample.name == "ftsup_goodput_ratio":
                got["ratio"] = sample.value
    return got


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """The run, the last scrape its metrics endpoint answered, and `ftsup status --json` after it ended."""
    tmp = tmp_path_factory.mktemp("goodput")
    port = free_port()
    job = write_job(
        tmp, "--fault", "kill@7", "--fault-rank", "1", "--min-step-s", "0.3", metrics={"listen": f"127.0.0.1:{port}"}
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        last: dict[str, Any] | None = None

        def ended() -> bool:
            nonlocal last
            if (got := scrape(f"http://127.0.0.1:{port}/metrics")) is not None and "productive_s" in got:
                last = got
            return proc.poll() is not None

        wait_for(ended, 240, "the supervised run did not end within 240 s", poll_s=0.05)
        assert proc.returncode == 0, proc.stderr.read()[-4000:] if proc.stderr else ""
        assert last is not None, "the metrics endpoint never answered"
        status = ftsup("status", "--config", str(job), "--json", timeout=60)
        assert status.returncode == 0, status.output
        yield tmp, last, json.loads(status.output)["goodput"]
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()


def test_the_prometheus_figures_agree_with_status_json_within_2_points(killed_run):
    _, scraped, status = killed_run
    badput = sum(scraped["badput_s"].values())
    assert abs(scraped["ratio"] - status["ratio"]) <= 0.02
    assert abs(scraped["productive_s"] / (scraped["productive_s"] + badput) - status["ratio"]) <= 0.02


def test_every_cause_is_exported_and_shown(killed_run):
    _, scraped, status = killed_run
    assert set(scraped["badput_s"]) == set(CAUSES) == set(status["badput_s"])


def test_the_accounted_wall_time_is_the_supervisors_whole_run(killed_run):
    tmp, _, status = killed_run
    stamps = [stamp(e) for e in events(tmp)]
    ran = max(stamps) - min(stamps)  # from supervisor_started to supervisor_exited
    assert ran - 1.0 <= status["wall_s"] <= ran
    assert status["wall_s"] == pytest.approx(status["productive_s"] + sum(status["badput_s"].values()), abs=0.01)


def test_the_kill_shows_as_startup_detection_backoff_and_wasted_progress(killed_run):
    _, _, status = killed_run
    lost = status["badput_s"]
    assert lost["startup"] > 0 and lost["detection"] > 0 and lost["checkpoint_save"] > 0
    assert lost["backoff"] == pytest.approx(0.0, abs=0.15)  # a failure after progress restarts at once
    # Steps 5, 6 and 7 trained again, --min-step-s each at least, as beats read once a tick (0.1 s) time them.
    assert lost["wasted_progress"] >= 3 * 0.3 - 2 * 0.1
    assert lost["eviction"] == 0
    assert 0 < status["ratio"] < 1


def test_a_supervisor_restarted_after_sigkill_goes_on_counting_and_its_downtime_is_other(tmp_path):
    # Steps of at least 0.5 s leave seconds between the first checkpoint and the run's end, in which the
    # supervisor is killed; the ranks' parent-death guards take the attempt down with it.
    job = write_job(tmp_path, "--min-step-s", "0.5")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: (tmp_path / "ckpt" / "step-000000004").is_dir(), 120, "no checkpoint of step 4")
        first = json.loads((tmp_path / "state" / "journal.json").read_text())["goodput"]
        killed_at = time.time()
        proc.kill()
        proc.wait(timeout=10)
    finally:
        kill_tree(proc.pid)
    r = ftsup("run", "--config", str(job))
    assert r.returncode == 0, r.output[-4000:]
    starts = [stamp(e) for e in events(tmp_path) if e["event"] == "supervisor_started"]
    assert len(starts) == 2
    got = json.loads(ftsup("status", "--config", str(job), "--json", timeout=60).output)["goodput"]
    assert got["wall_s"] == pytest.approx(max(map(stamp, events(tmp_path))) - starts[0], abs=1.0)
    assert got["badput_s"]["other"] >= starts[1] - killed_at  # the supervisor's downtime, at the least
    assert got["productive_s"] > first["productive_s"]


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()
